"""The check across torchft replica groups (lmforge.fault.group_check) without processes: the fingerprints' exact
16-bit chunks, the odd group out of three, the two-group (and tie) ambiguity, and three groups' checks run over a
summed exchange, one group's weight with a flipped bit (the bitflip drill's flip_bit); the torchft Manager's state a
resumed group starts from (lmforge.fault.replica_ft.manager_start_state and a real Manager on a Lighthouse in this
process)."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest
import torch
from torch import nn
from torchft._torchft import LighthouseServer

from lmforge.config.fault import FaultConfig
from lmforge.fault.consistency import state_fingerprints
from lmforge.fault.drills import flip_bit
from lmforge.fault.group_check import GroupCheck, GroupMismatch, from_chunks, odd_groups, to_chunks
from lmforge.fault.replica_ft import ReplicaFT, manager_start_state


def test_fingerprints_travel_as_exact_chunks_whatever_their_sign():
    values = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789012345678], dtype=torch.int64)
    chunks = to_chunks(values)
    assert chunks.dtype == torch.float64 and chunks.numel() == 4 * values.numel()
    assert chunks.max() <= 0xFFFF and chunks.min() >= 0
    assert from_chunks(chunks.tolist()) == [v % 2**64 for v in values.tolist()]
    rows = torch.zeros(3, chunks.numel(), dtype=torch.float64)
    rows[1] = chunks  # one nonzero row per group: the sum over groups is exact
    assert from_chunks(rows.sum(0).tolist()) == [v % 2**64 for v in values.tolist()]


def test_the_odd_group_of_three_is_named_and_two_groups_cannot_say_which():
    good, bad = to_chunks(torch.tensor([5, 7, 9])).tolist(), to_chunks(torch.tensor([5, 7 + 2**40, 9])).tolist()
    assert odd_groups({0: good, 1: bad, 2: good}) == ([1], [1])  # tensor 1 differs, group 1 is the minority
    assert odd_groups({0: good, 2: good, 5: good}) == ([], [])
    assert odd_groups({0: good, 3: bad}) == ([0, 3], [1])  # two groups: no majority, both suspect
    assert odd_groups({0: good, 1: bad, 2: good, 3: bad})[0] == [0, 1, 2, 3]  # a tie: every group
    two = GroupMismatch(4, [0, 3], [0, 3], ["h.0.w"])
    three = GroupMismatch(4, [1], [0, 1, 2], ["h.0.w"])
    assert two.ambiguous and "no majority" in two.describe()
    assert not three.ambiguous and three.describe().startswith("replica group(s) 1 differ from the other groups (0, 2)")


def _groups(n: int) -> List[nn.Module]:
    models = []
    for _ in range(n):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    return models


def _check_all(models: List[nn.Module], participants: List[int], step: int) -> list:
    """Every participant's GroupCheck at ``step`` over one exchange: each group's row of chunks, summed (what the
    Manager's all-reduce gives each of them)."""
    total = torch.zeros(0)
    for g in participants:
        names, sums = state_fingerprints(models[g], None, torch.device("cpu"))
        row = torch.zeros(len(models), 4 * len(names), dtype=torch.float64)
        row[g] = to_chunks(sums)
        total = row if total.numel() == 0 else total + row

    def summed(tensor):
        tensor.copy_(total)
        return True

    checks = [
        GroupCheck(
            1,
            models[g],
            None,
            torch.device("cpu"),
            replica_id=g,
            groups=len(models),
            exchange=summed,
            participants=lambda: participants,
            group_size=1,
        )  # fmt: skip
        for g in participants
    ]
    return [c.check(step) for c in checks]


def test_three_groups_name_the_one_whose_weight_flipped_and_agree_without_it():
    models = _groups(3)
    assert _check_all(models, [0, 1, 2], step=2) == [None, None, None]  # control: equal states agree
    flip_bit(models[1].named_parameters(), "1.weight", 12)
    found = _check_all(models, [0, 1, 2], step=3)
    assert [f.suspects for f in found] == [[1], [1], [1]] and found[0].tensors == ["1.weight"]
    assert _check_all(models, [0, 2], step=4) == [None, None]  # the corrupt group left: the others agree
    two = _check_all(models, [0, 1], step=5)
    assert [f.suspects for f in two] == [[0, 1], [0, 1]] and all(f.ambiguous for f in two)


def test_a_resumed_group_starts_its_manager_from_the_checkpoints_count():
    said = []
    assert manager_start_state({"step": 30, "batches_committed": 87}, 30, said.append) == {
        "step": 30,
        "batches_committed": 87,
    }
    assert said == []
    assert manager_start_state(None, 0, said.append) == {"step": 0, "batches_committed": 0} and said == []
    old = manager_start_state(None, 30, said.append)  # a checkpoint saved without the Manager's state
    assert old == {"step": 30, "batches_committed": 0}
    assert said == [
        "lmforge: note: replica_ft=torchft: the checkpoint of step 30 holds no torchft Manager state; its count of "
        "committed batches starts at 0"
    ]


@pytest.fixture
def lighthouse():
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    yield server.address()
    server.shutdown()


def test_a_real_manager_continues_the_checkpointed_batches_committed(lighthouse, tmp_path: Path):
    cfg = FaultConfig(replica_ft="torchft", lighthouse=lighthouse, replica_timeout_s=5)

    def start(saved):
        ft = ReplicaFT(
            cfg, engine=None, data=None, plan=None, run_dir=tmp_path, rank=0, world_size=1,
            get_step=lambda: 12, set_step=lambda _s: None, manager_state=saved,
        )  # fmt: skip
        try:
            return ft.manager.batches_committed(), ft.manager.current_step(), ft.state_dict()
        finally:
            ft.close()

    assert start({"step": 12, "batches_committed": 31}) == (31, 12, {"step": 12, "batches_committed": 31})
    assert start(None)[0] == 0  # negative control: the Manager's own start (no checkpointed state) counts from 0
