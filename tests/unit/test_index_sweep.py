"""``index_cache.sweep_torn`` on a hand-made index directory (no training, milliseconds): complete sets stay,
torn sets (an array missing or cut short) and arrays whose description is gone are deleted, each set whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lmforge.data.index_cache import ARRAYS, sweep_torn


def write_set(index: Path, digest: str, cls: str) -> list:
    """One megatron-core cache set: ``<md5>-<Class>-train-description.txt`` and its arrays."""
    base = f"{digest}-{cls}-train-"
    (index / f"{base}description.txt").write_text("{}")
    for affix in ARRAYS[cls]:
        np.save(index / f"{base}{affix}", np.arange(64, dtype=np.int64))
    return sorted(p.name for p in index.glob(f"{digest}-*"))


def test_sweep_keeps_complete_sets_and_removes_torn_sets_and_orphaned_arrays(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    kept = write_set(index, "a" * 32, "GPTDataset") + write_set(index, "b" * 32, "BlendedDataset")
    write_set(index, "c" * 32, "GPTDataset")  # torn: one array cut short mid-write
    cut = index / f"{'c' * 32}-GPTDataset-train-shuffle_index.npy"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    write_set(index, "d" * 32, "BlendedDataset")  # torn: one array never written
    (index / f"{'d' * 32}-BlendedDataset-train-dataset_sample_index.npy").unlink()
    write_set(index, "e" * 32, "GPTDataset")  # orphaned: the description is gone, the arrays stay behind
    (index / f"{'e' * 32}-GPTDataset-train-description.txt").unlink()
    (index / ".build.lock").write_text("")

    removed = sweep_torn(index)

    assert sorted(p.name for p in index.iterdir() if p.name != ".build.lock") == kept
    assert sorted(removed) == sorted(
        [f"{'c' * 32}-GPTDataset-train", f"{'d' * 32}-BlendedDataset-train"]
        + [f"{'e' * 32}-GPTDataset-train"] * len(ARRAYS["GPTDataset"])
    )
    assert sweep_torn(index) == []  # the negative control: a clean directory loses nothing
    assert sorted(p.name for p in index.iterdir() if p.name != ".build.lock") == kept
