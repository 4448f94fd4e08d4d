"""Each key's meaning lives with its field: the attribute docstring in config/<group>.py."""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.config.keys import catalogue, field_docs, keys, pattern_of


def test_every_key_of_the_schema_has_a_meaning():
    undocumented = [k.key for k in keys() if not k.meaning]
    assert not undocumented, f"fields without a docstring: {undocumented}"


@dataclass
class _Half:
    documented: int = 1
    """What it means."""
    bare: int = 2  # a comment is not a meaning


def test_a_field_without_a_docstring_has_no_meaning():
    assert field_docs(_Half) == {"documented": "What it means."}
    assert [k.meaning for k in keys(_Half)] == ["What it means.", ""]


def test_a_key_carries_default_type_and_choices():
    precision = catalogue()["train.precision"]
    assert (precision.default, precision.type, precision.choices) == (
        "auto",
        "str",
        ("auto", "fp32", "bf16-mixed", "bf16", "fp8"),
    )
    kv = catalogue()["model.n_kv_heads"]
    assert (kv.default, kv.type, kv.choices) == (None, "int | null", None)
    assert kv.meaning.startswith("Key/value heads: null = n_heads (multi-head attention), 1 = multi-query")


def test_a_mapping_entry_is_described_by_its_dataclass():
    assert pattern_of("data.sources.books.path") == "data.sources.*.path"
    assert catalogue()["data.sources.*.weight"].meaning.startswith("Share of this source")
    assert pattern_of("model.n_layr") is None
