"""Each ``validate`` entry of tests/doc_commands.yaml: its Hydra overrides (as its launcher passes them on) compose
and pass ``validate`` at the entry's world size, in-process, exactly the checks every rank of that launch runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from doc_commands import hydra_overrides, load_manifest  # noqa: E402

from lmforge.config.compose import compose  # noqa: E402
from lmforge.config.errors import ConfigError  # noqa: E402
from lmforge.config.validate import planned_world_size, validate  # noqa: E402

ENTRIES = [e for e in load_manifest() if e["class"] == "validate"]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e["command"][:80] for e in ENTRIES])
def test_validate_entry_composes_and_validates_at_its_world_size(entry):
    overrides = hydra_overrides(entry["command"])
    assert overrides, f"no Hydra overrides found in {entry['command']!r}"
    cfg = compose(overrides)
    planned = planned_world_size(cfg)
    nodes_named = any(o.startswith("cluster.nodes=") for o in overrides)
    if nodes_named:  # the entry's world is the one the command's nodes x GPUs per node give
        assert planned == entry["world"], (
            f"{entry['command']}: cluster gives world {planned}, entry says {entry['world']}"
        )
    validated = validate(cfg, world_size=entry["world"])
    assert validated.plan is not None


def test_a_layout_at_the_wrong_world_size_is_refused():
    """The negative control: gpt_1b on 4 nodes (HSDP, dp_replicate = cluster.nodes) does not fit 3 ranks."""
    cfg = compose(hydra_overrides("lmforge plan +exp=gpt_1b cluster.nodes=4"))
    with pytest.raises(ConfigError):
        validate(cfg, world_size=3)
