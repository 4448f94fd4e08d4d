"""The scale benchmarks' own logic at small size (benchmarks/scale_growth.py, scale_rank.py, scale_data.py): the
model check fits one constant and reports how far the points are from it, the counting store counts every store
operation it forwards, and the data corpus is marked copy by copy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import scale_data, scale_growth, scale_rank  # noqa: E402

WORLDS = (1, 2, 4, 8, 16, 32)


def point(w: int, chunks_per_rank: int = 123) -> dict:
    """A world's point that follows every model exactly (the constants are the measured ones of the tiny model)."""
    return {
        "world": w,
        "checkpoint_files": w + 3,
        "checkpoint_bytes": 15_700_000 + 235_000 * w,
        "metadata_bytes": 160_000 + 25_000 * w,
        "metadata_chunks": 468 + chunks_per_rank * w,
        "metadata_entries": 585 + 6 * w,
        "store_ops_per_rank_max": 13 + 2 * w,
        "store_ops_total": w * (13 + 2 * w),
        "gathered_bytes_rank0_startup": 47 + 4 * w,
        "gathered_bytes_rank0_save": 270_000 + 150_000 * w,
        "collectives_per_step_rank0": 17,
        "cpu_s_startup_per_rank": 1.2,
        "peak_rss_mib_rank0": 400.0 + (270_000 + 150_000 * w + 160_000 + 25_000 * w - 620_000) / 2**20,
    }


def test_points_on_the_models_fit_exactly_and_extrapolate_from_them():
    fits = scale_growth.fit_all([point(w) for w in WORLDS])
    assert set(fits) == set(scale_growth.MODELS) | set(scale_growth.DERIVED)
    for key, f in fits.items():
        assert f["max_rel_deviation"] < 1e-9, (key, f)
    assert fits["metadata_chunks"]["c"] == 123
    assert fits["metadata_chunks"]["extrapolated"]["16384"] == 468 + 123 * 16384
    assert fits["store_ops_total"]["extrapolated"]["1024"] == 1024 * (13 + 2 * 1024)
    assert fits["collectives_per_step_rank0"]["extrapolated"]["16384"] == 17


def test_a_point_off_its_model_shows_as_deviation():
    points = [point(w) for w in WORLDS[:-1]] + [point(32, chunks_per_rank=140)]  # chunks grow faster at W = 32
    f = scale_growth.fit_all(points)["metadata_chunks"]
    assert f["max_rel_deviation"] > 0.02
    assert scale_growth.fit_all(points)["checkpoint_files"]["max_rel_deviation"] < 1e-9  # control


def test_a_negative_slope_of_a_noisy_quantity_is_reported_as_unresolved():
    points = [{**point(w), "cpu_s_startup_per_rank": 1.4 - 0.01 * w} for w in WORLDS]
    assert scale_growth.fit_all(points)["cpu_s_startup_per_rank"]["c"] == 0.0


def data_row(mb: float, index_cpu_s: float) -> dict:
    samples = int(mb * 516)
    return {
        "corpus_mb": mb,
        "samples": samples,
        "tokens": samples * 512,
        "seq_len": 512,
        "prepare": {"cpu_s": 3.0 + 0.44 * mb},
        "index_build": {"cpu_s": index_cpu_s},
        "loader_start": {"cpu_s": 2.3},
    }


def test_data_growth_below_resolution_is_bounded_by_the_points_spread():
    rows = [data_row(10, 3.25), data_row(300, 3.26), data_row(1000, 3.22)]  # flat within 0.04 CPU-s
    models = scale_data.check_models(rows)
    index = models["index_build"]
    assert index["c"] == 0.0 and abs(index["extrapolated_cpu_s"]["1e+06MB"] - 3.25) <= 0.05  # flat: the first point
    assert abs(index["c_upper"] - 0.04 / (rows[-1]["samples"] - rows[0]["samples"])) < 1e-15
    at_1tb = 3.25 + index["c_upper"] * (1_000_000 * 516 - rows[0]["samples"])  # 1 TB's samples, at the bound
    assert abs(index["extrapolated_cpu_s_upper"]["1e+06MB"] - at_1tb) <= 0.05 and at_1tb > 40
    assert "c_upper" not in models["prepare"]  # control: a growth the points resolve is fitted, not bounded
    assert abs(models["prepare"]["c"] - 0.44) < 1e-9


def test_the_counting_store_counts_what_it_forwards_under_the_phase():
    import torch.distributed as dist

    store = scale_rank.counting_store_class()(dist.HashStore())
    tally, scale_rank.TALLY = scale_rank.TALLY, scale_rank.Tally()
    try:
        store.set("a", b"1")
        assert store.get("a") == b"1"
        assert store.add("n", 2) == 2
        store.wait(["a"])
        scale_rank.TALLY.phase = "save"
        assert store.check(["a"]) and store.num_keys() >= 2
        assert dict(scale_rank.TALLY.store) == {
            "startup:set": 1,
            "startup:get": 1,
            "startup:add": 1,
            "startup:wait": 1,
            "save:check": 1,
            "save:num_keys": 1,
        }
    finally:
        scale_rank.TALLY = tally


def test_the_data_corpus_marks_each_copy(tmp_path, monkeypatch):
    import lmforge.data.embedded as embedded

    monkeypatch.setattr(embedded, "iter_documents", lambda name: iter([f"{name} one " * 50, f"{name} two " * 50]))
    facts = scale_data.write_corpus(0.01, tmp_path / "raw")
    docs = [json.loads(line)["text"] for f in sorted((tmp_path / "raw").glob("*.jsonl")) for line in f.open()]
    assert len(docs) == facts["documents"] and facts["text_bytes"] >= 0.01e6 and facts["copies"] > 5
    assert docs[0].startswith("copy 0\nbooks one") and docs[4].startswith("copy 1\nbooks one")
    assert len(set(docs)) == len(docs)  # the same text in every copy, no two documents equal
