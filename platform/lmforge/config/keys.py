"""Every key of the schema: its type, default, allowed values and meaning.

A key's meaning is its field's attribute docstring (the string literal on the line after the field in
``config/<group>.py``), read here from the source with ``ast``; its allowed values are the field's
``Annotated[str, Literal[...]]`` annotation (``config/choices.py``), its range an ``Annotated[int, Range(...)]``
one (``config/ranges.py``). ``lmforge config show`` prints them, and
tests/unit/test_config_keys.py checks that every field has a meaning. Keys below a mapping of dataclasses
(``data.sources.<name>.path``) are listed once, with ``*`` for the name.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from functools import lru_cache
from typing import Any, Dict, Iterator, Optional, Tuple

from lmforge.config.choices import allowed_values
from lmforge.config.ranges import range_of
from lmforge.config.schema import RootConfig


@dataclass(frozen=True)
class Key:
    """One key of the schema."""

    key: str
    type: str
    default: Any
    choices: Optional[Tuple[str, ...]]
    meaning: str
    range: Optional[str] = None  # the allowed interval, e.g. ">= 1" (config/ranges.py)


@lru_cache(maxsize=None)
def field_docs(cls: type) -> Dict[str, str]:
    """``field name -> attribute docstring`` of a dataclass (one paragraph; fields without one are absent)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # the class statement's body
    docs: Dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def type_name(hint: Any) -> str:
    """A field's type as a user reads it: ``int``, ``int | null``, ``list[int] | null``, ``str``."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return type_name(typing.get_args(hint)[0])
    if origin is typing.Union:
        return " | ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(hint))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(hint))}]"
    return getattr(hint, "__name__", str(hint))


def _default(f: Any) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def _mapped_dataclass(hint: Any) -> Optional[type]:
    """``X`` of ``Dict[str, X]`` when X is a dataclass (a free-form mapping of typed entries)."""
    if typing.get_origin(hint) is dict:
        value = typing.get_args(hint)[1]
        if is_dataclass(value):
            return value
    return None


def keys(schema: type = RootConfig, prefix: str = "") -> Iterator[Key]:
    """Every leaf key of ``schema`` (nested dataclasses walked; a mapping of dataclasses as ``<key>.*.<field>``)."""
    hints = typing.get_type_hints(schema, include_extras=True)
    docs = field_docs(schema)
    for f in fields(schema):
        hint = hints[f.name]
        dotted = f"{prefix}{f.name}"
        if is_dataclass(hint):
            yield from keys(hint, f"{dotted}.")
            continue
        bounds = range_of(hint)
        yield Key(
            dotted,
            type_name(hint),
            _default(f),
            allowed_values(hint),
            docs.get(f.name, ""),
            str(bounds) if bounds is not None else None,
        )
        entry = _mapped_dataclass(hint)
        if entry is not None:
            yield from keys(entry, f"{dotted}.*.")


def sections(schema: type = RootConfig, prefix: str = "") -> Iterator[Tuple[str, str]]:
    """``(dotted section, meaning)`` of every nested dataclass field (``model``, ``model.moe``, ...)."""
    hints = typing.get_type_hints(schema, include_extras=True)
    docs = field_docs(schema)
    for f in fields(schema):
        if is_dataclass(hints[f.name]):
            yield f"{prefix}{f.name}", docs.get(f.name, "")
            yield from sections(hints[f.name], f"{prefix}{f.name}.")


@lru_cache(maxsize=None)
def catalogue() -> Dict[str, Key]:
    """``dotted key -> Key`` for every leaf of ``RootConfig``."""
    return {k.key: k for k in keys()}


def pattern_of(key: str) -> Optional[str]:
    """The catalogue key that describes ``key``: itself, or with a mapping entry's name as ``*``
    (``data.sources.books.path`` -> ``data.sources.*.path``); None when the schema has no such key."""
    table = catalogue()
    if key in table:
        return key
    parts = key.split(".")
    for i in range(1, len(parts)):
        candidate = ".".join(parts[:i] + ["*"] + parts[i + 1 :])
        if candidate in table:
            return candidate
    return None
