"""A run that would repeat a source of its mixture more than data.max_epochs times is refused, before any
process group (``lmforge train``), in ``lmforge plan``, and by the mixture builder once shards are prepared."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmforge.config.compose import compose
from lmforge.config.data import DataConfig, DataSourceConfig
from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate
from lmforge.data.epochs import check_epochs, prepare_embedded, source_epochs, train_split_tokens


def reference_only(max_epochs: float = 4.0) -> DataConfig:
    return DataConfig(
        sources={"reference": DataSourceConfig(path="embedded:reference", weight=1.0)}, max_epochs=max_epochs
    )


@pytest.fixture(scope="module")
def prepared(data_cache) -> Path:
    """The session's data cache with the default mixture's embedded corpora prepared (once, under their locks, as
    the first training start prepares them): the epochs are counted from the shards' real token counts."""
    prepare_embedded(validate(compose([])).data, data_cache)  # conf/data/default.yaml: books, code, reference
    return data_cache


def test_plan_refuses_a_cluster_preset_on_the_embedded_corpus_and_reports_the_epochs_of_smoke(
    prepared, capsys, monkeypatch
):
    from lmforge.cli import main

    monkeypatch.setenv("LMFORGE_DATA_CACHE", str(prepared))
    monkeypatch.setenv("LMFORGE_CORPORA", str(prepared / "no-corpora-here"))
    # The README's line: gpt_1b reads its prepared corpus (conf/data/corpus.yaml), so a warm embedded cache is no
    # reason to refuse the plan; the data line names the corpus still to prepare.
    assert main(["plan", "+exp=gpt_1b", "cluster.nodes=4"]) == 0
    out, err = capsys.readouterr()
    assert "fits       yes" in out and err == "", err
    assert out.splitlines()[-1] == (
        "data       epochs unknown until the shards are prepared (`lmforge data prepare`); not prepared yet: "
        f"pretrain ({prepared / 'no-corpora-here'}/pretrain)"
    )
    # Negative control: the same preset on the embedded mixture would read it 50,161 times.
    assert main(["plan", "+exp=gpt_1b", "data=default"]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("lmforge plan: refused: config key 'data.max_epochs'") and "50,161.0 times" in err
    assert "fits       yes" in out  # the plan itself is still shown
    assert main(["plan", "+exp=smoke"]) == 0
    out, err = capsys.readouterr()
    assert "data       epochs per source: books 0.35, code 0.11, reference 0.59 (data.max_epochs 4)" in out, err


def test_a_start_refuses_a_corpus_with_no_shards_before_any_tokenizer_work(tmp_path):
    from lmforge.data.sharded_prepare import MANIFEST
    from lmforge.data.sources import check_sources_present, unprepared_sources

    missing = DataConfig(sources={"pretrain": DataSourceConfig(path=str(tmp_path / "pretrain"))})
    with pytest.raises(ConfigError, match=r"'data.sources.pretrain.path': no Megatron shard at prefix .*pretrain "):
        check_sources_present(missing)
    assert unprepared_sources(missing) == [f"pretrain ({tmp_path / 'pretrain'})"]
    (tmp_path / "shards").mkdir()
    half = DataConfig(sources={"web": DataSourceConfig(path=str(tmp_path / "shards"))})
    with pytest.raises(ConfigError, match=rf"'data.sources.web.path': .* it holds no {MANIFEST}"):
        check_sources_present(half)  # a directory without its manifest: an unfinished --shard-size preparation
    (tmp_path / "pretrain.bin").write_bytes(b"")
    (tmp_path / "pretrain.idx").write_bytes(b"")
    check_sources_present(missing)  # present (check_shard reads and checks it when the mixture is built)
    check_sources_present(reference_only())  # embedded corpora are prepared by the start itself
    assert unprepared_sources(missing) == [] and unprepared_sources(reference_only()) == []
    off = DataConfig(
        sources={"a": DataSourceConfig("embedded:books"), "b": DataSourceConfig(str(tmp_path / "nope"), weight=0.0)}
    )
    check_sources_present(off)  # weight 0 leaves a source out


def test_the_limit_is_exact_per_source_and_zero_disables_it(prepared):
    data_cache = prepared
    from lmforge.data.epochs import known_prefix

    cfg = reference_only()
    prefix = known_prefix("reference", "embedded:reference", cfg, data_cache)
    tokens = train_split_tokens(Path(f"{prefix}.idx"), cfg.valid_fraction)
    assert 100_000 < tokens < 113_354  # the train split of the 113,354-token corpus
    (ok,) = check_epochs(cfg, 4 * tokens, data_cache)
    assert ok.epochs == 4.0
    with pytest.raises(
        ConfigError,
        match=r"'reference' \(.* train tokens at weight 1, .*\) 4\.0 times, more than "
        r"data.max_epochs=4",
    ):
        check_epochs(cfg, 4 * tokens + 1, data_cache)
    assert check_epochs(reference_only(max_epochs=0), 1000 * tokens, data_cache)[0].epochs == 1000.0
    # The weight counts: half the weight, half the repeats.
    mix = DataConfig(
        sources={
            "reference": DataSourceConfig("embedded:reference", 0.5),
            "books": DataSourceConfig("embedded:books", 0.5),
        }
    )
    by_name = {s.name: s.epochs for s in source_epochs(mix, 4 * tokens, data_cache)}
    assert by_name["reference"] == 2.0 and 0 < by_name["books"] < 1


def test_the_mixture_builder_refuses_before_building_an_index_and_announces_a_repeat(data_cache, tmp_path, capsys):
    from lmforge.data.mixture import build_mixture
    from lmforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer("embedded", data_cache)
    index = data_cache / "index"  # absent in a fresh cache when this test runs first

    def index_files() -> set:
        return set(index.iterdir()) if index.exists() else set()

    before = index_files()
    with pytest.raises(ConfigError, match="data.max_epochs"):
        build_mixture(
            reference_only(),
            tok,
            seq_len=64,
            seed=1234,
            num_train_samples=100,
            num_valid_samples=8,
            cache_dir=data_cache,
            total_train_samples=10_000,
        )
    assert index_files() == before
    # Within the limit a repeat is allowed, and announced (console and the mixture's notes), never silent.
    mix = build_mixture(
        reference_only(),
        tok,
        seq_len=64,
        seed=1234,
        num_train_samples=100,
        num_valid_samples=8,
        cache_dir=data_cache,
        total_train_samples=3_000,
    )
    out = capsys.readouterr().out
    line = next(n for n in mix.notes if n.startswith("data: this run repeats its train split: reference "))
    assert line in out and line.endswith("x (data.max_epochs 4 refuses more)"), (line, out)
    assert 1.0 < float(line.split("reference ")[1].split("x")[0]) < 4.0
