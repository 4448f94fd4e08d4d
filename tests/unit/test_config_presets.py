"""Each default lives in one place: conf/ holds only what differs from the dataclass defaults."""

from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from lmforge.config.compose import compose, conf_dir
from lmforge.config.model import ModelConfig
from lmforge.config.presets import findings, leaves
from lmforge.config.schema import RootConfig


@pytest.fixture
def conf_copy(tmp_path):
    """A copy of conf/ to plant mistakes in."""
    copy = tmp_path / "conf"
    shutil.copytree(conf_dir(), copy)
    return copy


def append(path, text):
    path.write_text(path.read_text() + text)


def test_conf_repeats_and_contradicts_no_default():
    found = findings(conf_dir())
    assert not found, "\n".join(str(f) for f in found)


def test_a_planted_repeated_key_is_caught(conf_copy):
    append(conf_copy / "optim" / "adamw.yaml", "beta1: 0.9\n")
    assert [str(f) for f in findings(conf_copy)] == [
        f"{conf_copy / 'optim' / 'adamw.yaml'}: optim.beta1: repeats the schema default 0.9 (config/optim.py): "
        "delete the line"
    ]


def test_a_planted_repeat_in_a_nested_section_is_caught(conf_copy):
    append(conf_copy / "model" / "gpt_1b.yaml", "moe:\n  top_k: 2\n")
    assert [f.key for f in findings(conf_copy)] == ["model.moe.top_k"]


def test_a_contradicting_default_preset_is_caught(conf_copy):
    append(conf_copy / "checkpoint" / "default.yaml", "every_steps: 250\n")
    (found,) = findings(conf_copy)
    assert found.key == "checkpoint.every_steps"
    assert found.reason == (
        "the default preset sets 250, contradicting the schema default 500 (config/checkpoint.py): "
        "make 250 the dataclass default and delete the line"
    )


def test_an_experiment_repeating_its_preset_is_caught(conf_copy):
    append(conf_copy / "exp" / "gpt_1b.yaml", "checkpoint:\n  keep_last: 2\n")
    (found,) = findings(conf_copy)
    assert (found.key, found.reason) == (
        "checkpoint.keep_last",
        "repeats 2, which checkpoint/default.yaml already gives: delete the line",
    )


def test_an_experiment_pinning_a_value_another_preset_changes_is_kept(conf_copy):
    # parallelism/fsdp_zero2.yaml sets reshard_after_forward=false: the line keeps the experiment's value under
    # lmforge train parallelism=fsdp_zero2 +exp=gpt_1b, so it is no repetition.
    append(conf_copy / "exp" / "gpt_1b.yaml", "checkpoint:\n  enabled: true\n")
    text = (conf_copy / "exp" / "gpt_1b.yaml").read_text()
    (conf_copy / "exp" / "gpt_1b.yaml").write_text(
        text.replace("  dp_shard: 8\n", "  dp_shard: 8\n  reshard_after_forward: true\n")
    )
    assert [f.key for f in findings(conf_copy)] == ["checkpoint.enabled"]


def test_a_preset_named_other_than_its_file_is_caught(conf_copy):
    path = conf_copy / "parallelism" / "ddp.yaml"
    path.write_text(path.read_text().replace("name: ddp", "name: dp"))
    assert [(f.key, f.reason) for f in findings(conf_copy)] == [
        ("parallelism.name", "is 'dp', not the file's name 'ddp'")
    ]


def differing(a, b):
    """Leaf keys whose values differ between two nested dicts (``data.sources`` compared as one mapping)."""
    left, right = dict(leaves(a)), dict(leaves(b))
    keys = set(left) | set(right)
    return sorted(
        {k if not k.startswith("data.sources") else "data.sources" for k in keys if left.get(k) != right.get(k)}
    )


def default_composition():
    cfg = OmegaConf.to_container(compose([]), resolve=False)
    return cfg


# What the default composition trains that the dataclasses do not default to: conf/model/smoke.yaml's shape
# (ModelConfig holds the architecture's defaults and is named "custom") and data/default.yaml's sources.
DEFAULT_COMPOSITION_ONLY = ["data.sources", "model.n_kv_heads", "model.name", "model.seq_len"]


def test_root_config_is_the_default_composition_but_the_model_shape_and_the_sources():
    schema = OmegaConf.to_container(OmegaConf.structured(RootConfig))
    assert differing(schema, default_composition()) == DEFAULT_COMPOSITION_ONLY


def test_a_contradiction_planted_in_a_default_preset_makes_them_differ(conf_copy, monkeypatch):
    append(conf_copy / "train" / "default.yaml", "max_steps: 300\n")
    monkeypatch.setenv("LMFORGE_CONF_DIR", str(conf_copy))
    schema = OmegaConf.to_container(OmegaConf.structured(RootConfig))
    assert differing(schema, default_composition()) == sorted(DEFAULT_COMPOSITION_ONLY + ["train.max_steps"])


def test_the_model_default_is_named_for_no_preset():
    presets = {p.stem for p in (conf_dir() / "model").glob("*.yaml")}
    assert ModelConfig().name == "custom" and ModelConfig().name not in presets
