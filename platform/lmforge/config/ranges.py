"""Number fields' allowed intervals, written in the field's annotation: ``n_layers: PositiveInt = 4``.

``Annotated[int, Range(...)]`` is ``int`` to OmegaConf (as ``Annotated[str, Literal[...]]`` is ``str`` for the
choice fields, ``config/choices.py``); the ``Range`` inside is the one statement of the interval:
``check_ranges`` (run by ``validate()``) reads it from the dataclass fields and ``lmforge config show`` prints it.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Annotated, Any, Dict, Iterator, Optional, Tuple

from lmforge.config.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """``[low, high]`` (an end open when ``*_open``; no ``high``: no upper bound) and the fix a refusal suggests."""

    low: float
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    fix: str = ""

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return (
            f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
            f"{')' if self.high_open else ']'}"
        )


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Range(1, fix="set a positive value")
NON_NEGATIVE = Range(0, fix="set a value >= 0")
PositiveInt = Annotated[int, POSITIVE]
NonNegativeInt = Annotated[int, NON_NEGATIVE]
NonNegativeFloat = Annotated[float, NON_NEGATIVE]


def range_of(annotation: Any) -> Optional[Range]:
    """The ``Range`` of ``Annotated[int | float, Range(...)]`` (None for any other annotation)."""
    if typing.get_origin(annotation) is not typing.Annotated:
        return None
    return next((m for m in annotation.__metadata__ if isinstance(m, Range)), None)


def range_fields(schema: Any, prefix: str = "") -> Iterator[Tuple[str, Range]]:
    """``(dotted key, Range)`` for every number field of a dataclass schema with one, nested ones included."""
    hints: Dict[str, Any] = typing.get_type_hints(schema, include_extras=True)
    for f in fields(schema):
        hint = hints[f.name]
        allowed = range_of(hint)
        if allowed is not None:
            yield f"{prefix}{f.name}", allowed
        elif is_dataclass(hint):
            yield from range_fields(hint, f"{prefix}{f.name}.")


def check_ranges(obj: Any) -> None:
    """Raise ConfigError for the first number field of ``obj`` (a schema dataclass instance) outside its range."""
    for key, allowed in range_fields(type(obj)):
        value: Any = obj
        for part in key.split("."):
            value = getattr(value, part)
        if value is not None and not allowed.holds(value):  # None: an Optional key's "auto"
            raise ConfigError(key, f"must be {allowed}, got {value}", allowed.fix)
