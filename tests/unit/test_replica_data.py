"""The data stream under fault.replica_ft: replica group r of n reads slice r of an n x G global batch.

Each step's slices of the participating groups are disjoint and together the next n x G samples of the stream, in
order, so a membership change (n groups, then fewer, then n again) neither skips nor repeats a sample; a step no
group committed is rewound and read again identically (the redone step).
"""

from __future__ import annotations

import torch
from data_support import THREE_SOURCES, make_stream

from lmforge.data.loader import BatchStream

SEQ, MICRO, GLOBAL = 32, 2, 4  # each group: 2 micro batches of 2 per step
N = 512


def indices(stream: BatchStream, rank: int, count: int, base) -> list:
    stream.follow_replicas(base, rank, count)
    c = stream.state.consumed_samples
    return [i for j in range(stream.plan.grad_accum) for i in stream.sample_indices(c, j)]


def test_slices_partition_the_global_batch_across_membership_changes(data_cache):
    first = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, N)
    streams = [first] + [BatchStream(first.mixture, first.plan, dp_rank=0, device=torch.device("cpu")) for _ in "12"]
    base = streams[0].plan
    seen = []
    for members in ([0, 1, 2], [0, 2], [0, 2], [0, 1, 2]):  # group 1 down for two steps, then back (healed)
        start = streams[members[0]].state.consumed_samples
        step = []
        for rank, g in enumerate(members):
            step += indices(streams[g], rank, len(members), base)
            streams[g].step_batches()
        assert sorted(step) == list(range(start, start + len(members) * GLOBAL))
        seen += step
        for g in members:
            assert streams[g].state.consumed_samples == start + len(members) * GLOBAL
        for g in set(range(3)) - set(members):  # what healing does: the peers' stream position
            streams[g].load_state_dict(streams[members[0]].state_dict())
    assert sorted(seen) == list(range(len(seen)))  # no sample skipped or read twice


def test_a_redone_step_reads_the_same_batches(data_cache):
    stream = make_stream(data_cache, THREE_SOURCES, SEQ, MICRO, GLOBAL, 1, 0, N)
    base = stream.plan
    stream.follow_replicas(base, 1, 3)
    before = stream.state.consumed_samples
    first = stream.step_batches()
    stream.rewind(before)
    again = stream.step_batches()
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(first, again))
    # negative control: without the rewind the next read is the following step's slice
    other = stream.step_batches()
    assert not torch.equal(first[0].tokens, other[0].tokens)
