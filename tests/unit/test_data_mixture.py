"""The mixture stream on real text: realised shares, resume, extension, and megatron-core's index cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from data_support import THREE_SOURCES, make_stream, step_records

from lmforge.config.train import TrainConfig
from lmforge.data.index_cache import sweep_torn
from lmforge.data.stream_size import stream_sizes

SEQ, MICRO, GLOBAL = 64, 16, 64


def test_realised_shares_of_consumed_samples_match_the_weights(data_cache, capsys):
    # Weights 5/3/2 are normalised to 0.5/0.3/0.2, and the run says so.
    stream = make_stream(data_cache, {"books": 5, "code": 3, "reference": 2}, SEQ, MICRO, GLOBAL, 1, 0, 10_240)
    assert "normalised to books=0.5000, code=0.3000, reference=0.2000" in capsys.readouterr().out
    counts = [0, 0, 0]
    steps = 10_240 // GLOBAL
    for _ in range(steps):  # the samples the trainer consumes, through the same BatchStream
        batches = stream.step_batches()
        per_source = {s: 0 for s in stream.mixture.sources}
        for mb in batches:
            assert mb.tokens.shape == (MICRO, SEQ) and torch.equal(mb.tokens[:, 1:], mb.targets[:, :-1])
            for sid in mb.source_ids:
                counts[sid] += 1
                per_source[stream.mixture.sources[sid]] += SEQ
        stream.count_tokens(per_source)
    assert sum(counts) == stream.state.consumed_samples == 10_240
    metrics = stream.share_metrics()
    for sid, (name, weight) in enumerate(zip(stream.mixture.sources, [0.5, 0.3, 0.2])):
        assert abs(counts[sid] / sum(counts) - weight) < 0.01, (name, counts)
        assert metrics[f"data/weight/{name}"] == pytest.approx(weight)
        assert metrics[f"data/share/{name}"] == pytest.approx(counts[sid] / sum(counts))


def test_resume_at_consumed_sample_k_continues_the_uninterrupted_stream(data_cache):
    whole = step_records(make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, 4096), 20)
    first = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, 4096)
    assert step_records(first, 7) == whole[:7]
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint sidecar stores it
    assert state["consumed_samples"] == 7 * GLOBAL and state["num_train_samples"] == 4096
    resumed = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, 4096)  # a new process would rebuild
    resumed.load_state_dict(state)
    assert step_records(resumed, 13) == whole[7:]
    other_n = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, 2048)
    with pytest.raises(ValueError, match="built for 4096 samples, this mixture for 2048"):
        other_n.load_state_dict(state)


def test_extending_max_steps_keeps_what_was_seen_and_adds_a_fresh_pass(data_cache):
    train = TrainConfig(max_steps=32, global_batch_size=GLOBAL)
    n, total = stream_sizes(train, GLOBAL * SEQ, GLOBAL, SEQ)
    assert (n, total) == (2048, 2048)
    longer = TrainConfig(max_steps=64, global_batch_size=GLOBAL)
    assert stream_sizes(longer, GLOBAL * SEQ, GLOBAL, SEQ, prior_state={"num_train_samples": n}) == (2048, 4096)
    planned = TrainConfig(max_steps=64, global_batch_size=GLOBAL, planned_tokens=2048 * SEQ)
    assert stream_sizes(planned, GLOBAL * SEQ, GLOBAL, SEQ) == (2048, 4096)

    base = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, n).mixture
    ext = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, n, total=4096).mixture
    assert ext.total_samples == 4096 and len(ext.passes) == 2
    probe = list(range(0, n, 97)) + [n - 1]
    for i in probe:
        assert torch.equal(
            torch.as_tensor(base.train_sample(i)["tokens"]), torch.as_tensor(ext.train_sample(i)["tokens"])
        )
    first = [torch.as_tensor(ext.train_sample(i)["tokens"])[:16].tolist() for i in range(64)]
    second = [torch.as_tensor(ext.train_sample(n + i)["tokens"])[:16].tolist() for i in range(64)]
    assert first != second  # pass 2 is a fresh shuffle (seed + 1), not a replay of pass 1
    with pytest.raises(IndexError, match="past the 1 pass"):
        base.train_sample(n)


def _files(cache: Path) -> set:
    return {p.name for p in (cache / "index").iterdir() if p.suffix in (".npy", ".txt")}


def test_index_cache_is_keyed_by_every_parameter_and_rebuilds_torn_sets(data_cache, tmp_path):
    shared, data_cache = data_cache, tmp_path / "cache"  # the session's shards and tokenizer, an empty index dir
    data_cache.mkdir()
    for sub in ("tokenizers", "shards"):
        (data_cache / sub).symlink_to(shared / sub)
    make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, 1000, seed=76)
    before = _files(data_cache)
    a = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, 1000, seed=77).mixture
    built = _files(data_cache) - before
    assert built, "a new seed must build new index files"
    descriptions = [json.loads((data_cache / "index" / f).read_text()) for f in built if f.endswith("description.txt")]
    assert any(d.get("random_seed") == 77 for d in descriptions)
    gpt = [d for d in descriptions if d["class"] == "GPTDataset"]
    assert all(d["tokenizer"]["fingerprint"] and d["tokenizer"]["shards"] for d in gpt)

    make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, 1000, seed=77)
    assert _files(data_cache) - before == built  # same parameters: reused, nothing new
    make_stream(data_cache, THREE_SOURCES, SEQ + 1, MICRO, GLOBAL, 1, 0, 1000, seed=77)
    assert len(_files(data_cache) - before - built) > 0  # another seq_len: new files, never the old ones

    # A crash mid-write leaves a torn set: it is removed and rebuilt, not loaded.
    victim = sorted(f for f in built if f.endswith("shuffle_index.npy"))[0]
    path = data_cache / "index" / victim
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size // 2)
    rebuilt = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, 1000, seed=77).mixture
    assert path.stat().st_size == size
    for i in (0, 1, 500, 999):
        assert torch.equal(
            torch.as_tensor(a.train_sample(i)["tokens"]), torch.as_tensor(rebuilt.train_sample(i)["tokens"])
        )
    assert sweep_torn(data_cache / "index") == []


def test_a_reprepared_shard_at_the_same_prefix_misses_the_cache(tmp_path, data_cache):
    from lmforge.data.embedded import iter_documents
    from lmforge.data.prepare import prepare
    from lmforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer("embedded", data_cache)
    docs = [d[:3000] for _, d in zip(range(52), (d for d in iter_documents("books") if len(d) > 2000))]
    cache = tmp_path / "cache"  # its own index dir, the session's tokenizer
    cache.mkdir()
    (cache / "tokenizers").symlink_to(data_cache / "tokenizers")
    prefix = tmp_path / "books"
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:26]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[26:]))
    prepare([str(tmp_path / "a.jsonl")], prefix, tok)
    make_stream(cache, {"books": 1.0}, SEQ, MICRO, GLOBAL, 1, 0, 500, paths={"books": str(prefix)})
    first = _files(cache)
    for ext in ("bin", "idx", "meta.json"):
        Path(f"{prefix}.{ext}").unlink()
    prepare([str(tmp_path / "b.jsonl")], prefix, tok)
    m = make_stream(cache, {"books": 1.0}, SEQ, MICRO, GLOBAL, 1, 0, 500, paths={"books": str(prefix)}).mixture
    assert _files(cache) - first, "same path, new content: the old index must not be reused"
    text = tok.decode(torch.as_tensor(m.train_sample(0)["tokens"]).tolist())
    assert any(text[:40] in d for d in docs[26:])


def test_index_builds_wait_for_the_cache_lock(data_cache, tmp_path):
    """Another job holding index/.build.lock keeps this rank 0 from writing until it lets go."""
    import threading

    from lmforge.data.file_lock import file_lock

    shared, cache = data_cache, tmp_path / "cache"
    cache.mkdir()
    for sub in ("tokenizers", "shards"):
        (cache / sub).symlink_to(shared / sub)
    (cache / "index").mkdir()
    done = []
    worker = threading.Thread(
        target=lambda: done.append(make_stream(cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, 300, seed=5))
    )
    with file_lock(cache / "index" / ".build.lock"):
        worker.start()
        worker.join(timeout=3.0)
        assert worker.is_alive() and not done and not _files(cache), "built without holding the cache lock"
    worker.join(timeout=120)
    assert done and any(f.endswith("description.txt") for f in _files(cache))


def test_fast_sample_path_equals_megatron_getitem(data_cache):
    mixture = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, 4096).mixture
    for i in list(range(0, 4096, 41)) + [4095]:
        text, source = mixture.train_text(i)
        sample = mixture.train_sample(i)
        assert source == int(sample["dataset_id"])
        assert text[:-1].tolist() == torch.as_tensor(sample["tokens"]).tolist()
        assert text[1:].tolist() == torch.as_tensor(sample["labels"]).tolist()
