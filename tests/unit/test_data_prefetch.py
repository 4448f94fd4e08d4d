"""Prefetched batches (data.num_workers >= 1) on the real embedded mixture: the same stream, the same resume.

The stream handed to the trainer must be bit-identical for any number of prefetch threads, its state must
count only the steps handed out, a resume must drop what was prefetched, a worker's error must reach the loop
with its traceback, and close() must stop the threads. The trainer-level check trains a tiny model through
the real Trainer with num_workers 0 and 2 in a fresh process and compares the losses bit for bit.
"""

from __future__ import annotations

import json
import threading
import traceback
from dataclasses import replace

import pytest
import torch
from data_support import THREE_SOURCES, make_stream

from lmforge.config.batch_ramp import BatchRamp
from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.seq_len_warmup import SeqLenWarmup
from lmforge.config.validate import validate
from lmforge.data.loader import BatchStream

SEQ, MICRO, GLOBAL, DP = 32, 2, 16, 2  # grad_accum 4 micro batches per step on each of 2 data-parallel ranks
N = 4096
STEPS = 10


def stream_with(base: BatchStream, workers: int, dp_rank: int = 1) -> BatchStream:
    return BatchStream(base.mixture, base.plan, dp_rank=dp_rank, device=torch.device("cpu"), num_workers=workers)


def take(stream: BatchStream, steps: int):
    """Per step: the micro batches exactly as handed out, and the state after the step."""
    out = []
    for _ in range(steps):
        batches = stream.step_batches()
        out.append(
            (
                [(mb.tokens.clone(), mb.targets.clone(), list(mb.source_ids)) for mb in batches],
                json.dumps(stream.state_dict(), sort_keys=True),
            )
        )
    return out


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for step, ((ba, sa), (bb, sb)) in enumerate(zip(a, b)):
        assert sa == sb, step
        assert len(ba) == len(bb) == GLOBAL // (MICRO * DP), step
        for (ta, ya, ia), (tb, yb, ib) in zip(ba, bb):
            assert ta.dtype == tb.dtype == torch.int64 and ta.shape == (MICRO, SEQ)
            assert torch.equal(ta, tb) and torch.equal(ya, yb) and ia == ib, step


@pytest.fixture(scope="module")
def base(data_cache) -> BatchStream:
    return make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, DP, 1, N)


def test_the_stream_is_bit_identical_for_0_1_2_workers(base):
    reference = take(stream_with(base, 0), STEPS)
    for workers in (1, 2):
        stream = stream_with(base, workers)
        try:
            first = take(stream, 1)
            # The next two steps are already being built while "step 1 trains"; the state counts only step 1.
            assert stream.prefetcher.queued_starts() == [GLOBAL, 2 * GLOBAL]
            assert json.loads(first[0][1])["consumed_samples"] == GLOBAL
            assert len(stream.prefetcher.pool.threads) == workers
            assert all(t.daemon and t.is_alive() for t in stream.prefetcher.pool.threads)
            assert_same(first + take(stream, STEPS - 1), reference)
        finally:
            stream.close()
    # Distinct ranks get distinct samples (the comparison above is not between empty or equal batches).
    other = take(stream_with(base, 2, dp_rank=0), 1)
    assert not torch.equal(other[0][0][0][0], reference[0][0][0][0])


def test_state_dict_and_resume_mid_stream_continue_exactly(base):
    reference = take(stream_with(base, 0), STEPS)
    first = stream_with(base, 2)
    try:
        assert_same(take(first, 4), reference[:4])
        state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint sidecar stores it
        assert state["consumed_samples"] == 4 * GLOBAL  # handed out, not prefetched
        assert first.prefetcher.queued_starts() == [4 * GLOBAL, 5 * GLOBAL]
        assert_same(take(first, STEPS - 4), reference[4:])
    finally:
        first.close()

    resumed = stream_with(base, 2)  # a new process resuming from the checkpoint
    try:
        resumed.load_state_dict(state)
        assert_same(take(resumed, STEPS - 4), reference[4:])
        # Rewinding a stream that has prefetched far ahead drops those steps and redoes the ones asked for.
        assert resumed.prefetcher.queued_starts() == [(STEPS + 0) * GLOBAL, (STEPS + 1) * GLOBAL]
        resumed.load_state_dict(json.loads(reference[1][1]))
        assert resumed.prefetcher.queued_starts() == []
        assert_same(take(resumed, 3), reference[2:5])
        # A state set by hand (as some tools do) is noticed too: the prefetched steps are for elsewhere.
        resumed.state.consumed_samples = 7 * GLOBAL
        assert_same(take(resumed, 3), reference[7:10])
    finally:
        resumed.close()


def test_a_worker_error_surfaces_in_the_loop_with_its_traceback(data_cache):
    small = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, DP, 1, 4 * GLOBAL)  # 4 steps of data
    sync, prefetched = stream_with(small, 0), stream_with(small, 2)
    try:
        assert_same(take(prefetched, 4), take(sync, 4))  # steps 5 and 6 already failed in the workers, unseen
        with pytest.raises(IndexError, match="past the 1 pass") as sync_error:
            sync.step_batches()
        with pytest.raises(IndexError, match="past the 1 pass") as error:
            prefetched.step_batches()
        assert str(error.value) == str(sync_error.value)
        assert prefetched.state.consumed_samples == 4 * GLOBAL  # the failed step was not consumed
        frames = [f.name for f in traceback.extract_tb(error.value.__traceback__)]
        assert "train_sample" in frames and "_host_batch" in frames, frames  # the worker's own frames
        notes = getattr(error.value, "__notes__", [])
        assert any(
            n.startswith("(raised in data worker thread lmforge-data-")
            and f"of the step at consumed_samples={4 * GLOBAL}" in n
            for n in notes
        ), notes
        with pytest.raises(IndexError, match="past the 1 pass"):  # asking again fails again, never hangs
            prefetched.step_batches()
    finally:
        prefetched.close()


def test_close_joins_the_threads_and_later_steps_match(base):
    reference = take(stream_with(base, 0), 3)
    idle = stream_with(base, 2)
    assert idle.prefetcher.pool is None  # no threads until the first training step (eval-only users pay nothing)
    idle.close()
    stream = stream_with(base, 2)
    assert_same(take(stream, 2), reference[:2])
    threads = list(stream.prefetcher.pool.threads)
    assert len(threads) == 2 and all(t.is_alive() for t in threads)
    stream.close()
    assert not any(t.is_alive() for t in threads) and stream.prefetcher is None
    assert not [t for t in threading.enumerate() if t in threads]
    stream.close()  # idempotent (the trainer closes in its finally)
    assert_same(take(stream, 1), reference[2:3])  # after close the calling thread builds the same batches


def test_negative_num_workers_is_a_config_error():
    with pytest.raises(ConfigError, match=r"config key 'data.num_workers': must be >= 0, got -1"):
        validate(compose(["data.num_workers=-1"]))
    assert validate(compose(["data.num_workers=2"])).data.num_workers == 2


RAMP = BatchRamp(start=4, increment=4, ramp_samples=48, global_batch=GLOBAL)  # 4, 4, 4, 4, 8, 8, 12, 12, 16, ...
WARMUP = SeqLenWarmup(seq_len=SEQ, start=8, warmup_samples=64)  # 4 pieces of 8 before 32 samples, 2 of 16 before 64


def scheduled(base: BatchStream, workers: int, dp_rank: int = 1, dp: int = DP) -> BatchStream:
    plan = replace(base.plan, dp_size=dp, grad_accum=GLOBAL // (MICRO * dp))
    return BatchStream(
        base.mixture,
        plan,
        dp_rank=dp_rank,
        device=torch.device("cpu"),
        num_workers=workers,
        batch_at=RAMP.batch_at,
        pieces_at=WARMUP.pieces_at,
    )


def rows(step) -> list:
    """A step's sequences as sorted token tuples (the multiset of what it trains, however it is sharded)."""
    return sorted(tuple(row.tolist()) for tokens, _, _ in step[0] for row in tokens)


def test_a_batch_ramp_and_a_length_warmup_prefetch_resume_and_shard_exactly(base):
    reference = take(scheduled(base, 0), STEPS)
    batches = [RAMP.batch_at(RAMP.samples_before(s)) for s in range(STEPS)]
    assert batches == [4, 4, 4, 4, 8, 8, 12, 12, 16, 16]
    pieces = [WARMUP.pieces_at(RAMP.samples_before(s)) for s in range(STEPS)]
    assert pieces == [4, 4, 4, 4, 4, 4, 2, 2, 2, 1]
    for (step, _state), batch, cut in zip(reference, batches, pieces):
        assert len(step) == batch // (MICRO * DP)  # micro batches on this rank
        assert all(tokens.shape == (MICRO * cut, SEQ // cut) for tokens, _, _ in step)
    assert json.loads(reference[-1][1])["consumed_samples"] == sum(batches)

    stream = scheduled(base, 2)
    try:
        head = take(stream, 4)
        state = json.loads(json.dumps(stream.state_dict()))
        assert stream.prefetcher.queued_starts() == [RAMP.samples_before(4), RAMP.samples_before(5)]
    finally:
        stream.close()
    resumed = scheduled(base, 2)
    try:
        resumed.load_state_dict(state)
        rest = take(resumed, STEPS - 4)
    finally:
        resumed.close()
    for a, b in zip(head + rest, reference):
        assert a[1] == b[1] and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a[0], b[0]))

    # the same sequences at DP 1 as at DP 2 (both ranks), step by step
    dp1 = take(scheduled(base, 0, dp_rank=0, dp=1), STEPS)
    rank0 = take(scheduled(base, 0, dp_rank=0), STEPS)
    for s in range(STEPS):
        assert rows(dp1[s]) == sorted(rows(rank0[s]) + rows(reference[s])), s
    assert rows(rank0[0]) != rows(reference[0])  # control: the ranks read different samples
