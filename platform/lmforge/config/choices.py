"""Choice fields: the allowed values are the schema annotation itself, ``Annotated[str, Literal[...]]``.

OmegaConf (2.3) rejects a bare ``Literal`` annotation and matches Enum values by member *name* (so
``bf16-mixed`` could not be one), but it reads ``Annotated[str, ...]`` as ``str``. The ``Literal`` inside the
annotation is the one list of allowed values: ``check_choices`` reads it from the dataclass fields and raises
a ConfigError with the closest valid value ("did you mean"); docs and error messages show the same list.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

from lmforge.config.errors import ConfigError


def allowed_values(annotation: Any) -> Optional[Tuple[str, ...]]:
    """The values of ``Annotated[str, Literal[...]]`` (None for any other annotation)."""
    if typing.get_origin(annotation) is not typing.Annotated:
        return None
    for meta in annotation.__metadata__:
        if typing.get_origin(meta) is typing.Literal:
            return tuple(typing.get_args(meta))
    return None


def choice_fields(schema: Any, prefix: str = "") -> Iterator[Tuple[str, Tuple[str, ...]]]:
    """``(dotted key, allowed values)`` for every choice field of a dataclass schema, nested ones included."""
    hints: Dict[str, Any] = typing.get_type_hints(schema, include_extras=True)
    for f in fields(schema):
        hint = hints[f.name]
        allowed = allowed_values(hint)
        if allowed is not None:
            yield f"{prefix}{f.name}", allowed
        elif is_dataclass(hint):
            yield from choice_fields(hint, f"{prefix}{f.name}.")


def closest(value: str, candidates) -> Optional[str]:
    hit = difflib.get_close_matches(value, list(candidates), n=1, cutoff=0.5)
    return hit[0] if hit else None


def check_choices(obj: Any, prefix: str = "") -> None:
    """Raise ConfigError for the first choice field of ``obj`` (a schema dataclass instance) holding another value."""
    for key, allowed in choice_fields(type(obj), prefix):
        value: Any = obj
        for part in key[len(prefix) :].split("."):
            value = getattr(value, part)
        if value not in allowed:
            near = closest(str(value), allowed)
            hint = f"did you mean '{near}'? " if near else ""
            raise ConfigError(
                key, f"'{value}' is not one of {', '.join(allowed)}", f"{hint}choose one of {', '.join(allowed)}"
            )
