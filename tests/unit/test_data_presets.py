"""The data presets compose through Hydra with >= 3 real sources and resolve their shard paths."""

from __future__ import annotations

from lmforge.config.compose import compose
from lmforge.config.validate import validate


def test_default_preset_mixes_three_embedded_sources():
    cfg = validate(compose([]), world_size=1)
    assert {n: s.path for n, s in cfg.data.sources.items()} == {
        "books": "embedded:books",
        "code": "embedded:code",
        "reference": "embedded:reference",
    }


def test_debian_preset_mixes_embedded_and_debian_package_shards(monkeypatch, tmp_path):
    monkeypatch.setenv("LMFORGE_CORPORA", str(tmp_path))
    cfg = validate(compose(["data=debian_mix"]), world_size=1)
    paths = {n: s.path for n, s in cfg.data.sources.items()}
    assert paths == {
        "books": "embedded:books",
        "code": "embedded:code",
        "kjv": f"{tmp_path}/kjv",
        "fortunes": f"{tmp_path}/fortunes",
    }
    assert abs(sum(s.weight for s in cfg.data.sources.values()) - 1.0) < 1e-9
