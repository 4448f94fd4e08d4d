"""Silent-data-corruption check: data-parallel replicas must hold bit-identical parameters and optimizer state.

Replicas of the same shard (the ``dp_replicate`` mesh dimension: every DP rank under DDP, the replicate
dimension under HSDP, ranks with the same TP/PP/FSDP coordinates otherwise) apply the same averaged gradient to
the same weights, so their tensors are equal bit for bit. A flipped bit in memory, a faulty GPU or a bad
collective breaks that silently: the loss may look fine for thousands of steps.

Every ``fault.consistency_every`` steps each rank computes one exact integer fingerprint per local tensor (the
raw bits viewed as integers of the same width and summed in int64, on the device: a single flipped bit changes
the sum by +-2^k, never 0 mod 2^64), all-gathers the small vector over its replica group only, and compares.
A mismatch names the ranks (with three or more replicas the minority; with two, both: nothing tells which of
the two is right) and the tensors. The verdict is shared with every rank (one all-reduce over the world of a
per-rank flag vector: 2 for a rank that differs from its group's majority, 1 for a suspect of a group without one)
so the whole job stops together and every rank knows which suspects are certain (``Mismatch.certain``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

# The integer dtype of each element width: a tensor's raw bits (fingerprints here, the bitflip drill).
INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, else ``t`` itself (detached)."""
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).detach()


def bit_fingerprint(t: torch.Tensor) -> torch.Tensor:
    """An int64 scalar on ``t``'s device: the sum of ``t``'s bit pattern read as same-width integers. Exact."""
    local = local_tensor(t)
    if local.dtype == torch.bool:
        local = local.to(torch.uint8)
    bits = local.view(INT_OF_WIDTH[local.element_size()]) if local.is_floating_point() or local.is_complex() else local
    return bits.sum(dtype=torch.int64)


def named_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> List[Tuple[str, torch.Tensor]]:
    """Every tensor replicas must agree on, by name: parameters, then each parameter's optimizer state."""
    params = list(model.named_parameters())
    out: List[Tuple[str, torch.Tensor]] = list(params)
    if optimizer is not None:
        for name, p in params:
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    out.append((f"optim.{name}.{key}", value))
    return out


def state_fingerprints(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer], device: torch.device
) -> Tuple[List[str], torch.Tensor]:
    """The names of ``named_state`` and an int64 vector on ``device`` of their ``bit_fingerprint`` (no host sync)."""
    named = named_state(model, optimizer)
    sums = [bit_fingerprint(t).to(device) for _, t in named]
    return [n for n, _ in named], torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=device)


@dataclass
class Mismatch:
    step: int
    suspects: List[int]  # global ranks whose tensors differ (both of a pair: which one is right is unknown)
    group: List[int] = field(default_factory=list)  # global ranks of the replica group that saw it ([] elsewhere)
    tensors: List[str] = field(default_factory=list)  # names of the differing tensors (known in that group)
    certain: List[int] = field(default_factory=list)  # the suspects that differ from their group's majority

    def describe(self) -> str:
        if not self.tensors:
            ranks = ", ".join(map(str, self.suspects))
            return f"rank(s) {ranks} hold tensors that differ from their data-parallel replicas"
        here = [r for r in self.suspects if r in self.group]
        ranks = ", ".join(map(str, here))
        shown = ", ".join(self.tensors[:8]) + (f" and {len(self.tensors) - 8} more" if len(self.tensors) > 8 else "")
        who = (
            f"ranks {ranks} disagree (no majority: any of them may be the corrupt one)"
            if len(here) == len(self.group)
            else f"rank(s) {ranks} differ from the other replicas "
            f"({', '.join(str(r) for r in self.group if r not in here)})"
        )
        return f"replicas {self.group} of the same shard: {who} on {len(self.tensors)} tensor(s): {shown}"


def disagreeing(rows: Sequence[Sequence[int]]) -> Tuple[List[int], List[int]]:
    """Given each replica's fingerprints (``rows[r][j]``), the replica positions that differ and the tensor
    indices where they do. A value held by a strict majority is right; without one, every replica is suspect."""
    suspects: set = set()
    columns: List[int] = []
    for j in range(len(rows[0]) if rows else 0):
        values = [row[j] for row in rows]
        if all(v == values[0] for v in values):
            continue
        columns.append(j)
        value, count = Counter(values).most_common(1)[0]
        if count * 2 > len(values):
            suspects.update(r for r, v in enumerate(values) if v != value)
        else:
            suspects.update(range(len(values)))
    return sorted(suspects), columns


class ReplicaCheck:
    """``check(step)`` every ``every`` steps: a collective over the replica group, then one over the world."""

    def __init__(
        self,
        every: int,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        group,
        device: torch.device,
        start_step: int = 0,
    ):
        self.every = every
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.device = device
        self.group_ranks: List[int] = dist.get_process_group_ranks(group)
        self.last_good_step = start_step  # the newest step whose state every replica group agreed on

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def fingerprints(self) -> Tuple[List[str], torch.Tensor]:
        return state_fingerprints(self.model, self.optimizer, self.device)

    @torch.no_grad()
    def check(self, step: int) -> Optional[Mismatch]:
        names, mine = self.fingerprints()
        gathered = [torch.empty_like(mine) for _ in self.group_ranks]
        dist.all_gather(gathered, mine, group=self.group)
        positions, columns = disagreeing([g.tolist() for g in gathered])
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=self.device)
        majority = len(positions) < len(self.group_ranks)  # a group where every replica is suspect has none
        for pos in positions:
            flags[self.group_ranks[pos]] = 2 if majority else 1
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every replica group learns of a mismatch anywhere
        values = flags.tolist()
        suspects = [r for r, f in enumerate(values) if f]
        if not suspects:
            self.last_good_step = step
            return None
        certain = [r for r, f in enumerate(values) if f == 2]
        if positions:
            return Mismatch(step, suspects, list(self.group_ranks), [names[j] for j in columns], certain)
        return Mismatch(step, suspects, certain=certain)
