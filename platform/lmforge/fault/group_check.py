"""Silent-data-corruption check across torchft replica groups (``fault.replica_ft=torchft``).

Every participant of a committed step holds the same parameters and optimizer state (the step started from the
same state, or a peer's state healed in, and applied the same averaged gradients). Every ``fault.consistency_every``
steps, after the step commits, each rank takes the exact per-tensor fingerprints of fault/consistency.py (its local
shards), splits each int64 into four 16-bit chunks (exact in float64), writes them into its group's row of a
groups x (tensors x 4) tensor and sums it through the torchft Manager's all-reduce (rank i of every group with
rank i of the others, as the gradients): every rank then holds every participating group's fingerprints of the
same shard. A group whose fingerprints differ from a strict majority's is the corrupt one; without a majority
(two groups, or a tie) every participant is suspect. The ranks of a group then combine their findings (one
all-reduce inside the group), so the whole group reaches one verdict: fault/hooks.py stops a suspect group with
the ``corrupted`` verdict (exit 47) and records a ``replica_mismatch`` event in every participant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lmforge.fault.consistency import disagreeing, state_fingerprints

CHUNKS = 4  # an int64 as four 16-bit chunks: each exact in float64, and the sum of one nonzero row is exact
CHUNK_MASK = 0xFFFF


def to_chunks(fingerprints: torch.Tensor) -> torch.Tensor:
    """int64 ``[T]`` -> float64 ``[T * 4]``: each value's 16-bit chunks, lowest first (two's complement bits)."""
    shifts = torch.arange(CHUNKS, dtype=torch.int64, device=fingerprints.device) * 16
    chunks = (fingerprints.reshape(-1, 1) >> shifts) & CHUNK_MASK
    return chunks.reshape(-1).to(torch.float64)


def from_chunks(chunks: Sequence[float]) -> List[int]:
    """The unsigned 64-bit values of ``to_chunks``' output (for reading; comparisons use the chunks)."""
    values = [int(round(c)) for c in chunks]
    return [sum(values[i + k] << (16 * k) for k in range(CHUNKS)) for i in range(0, len(values), CHUNKS)]


@dataclass
class GroupMismatch:
    step: int
    suspects: List[int]  # replica group ids whose state differs (every participant where there is no majority)
    participants: List[int]  # the replica groups of the committed step that were compared
    tensors: List[str] = field(default_factory=list)  # names of the differing tensors on this rank's shard

    @property
    def ambiguous(self) -> bool:
        """No majority: nothing tells which state is right."""
        return len(self.suspects) == len(self.participants)

    def describe(self) -> str:
        groups = ", ".join(map(str, self.suspects))
        if self.ambiguous:
            who = f"replica groups {groups} disagree (no majority: any of them may be the corrupt one)"
        else:
            others = ", ".join(str(g) for g in self.participants if g not in self.suspects)
            who = f"replica group(s) {groups} differ from the other groups ({others})"
        shown = ", ".join(self.tensors[:8]) + (f" and {len(self.tensors) - 8} more" if len(self.tensors) > 8 else "")
        where = f" on {len(self.tensors)} tensor(s): {shown}" if self.tensors else " (on another rank's shards)"
        return f"{who}{where}"


def odd_groups(rows: Dict[int, Sequence[float]]) -> tuple:
    """Given each participating group's chunks (``rows[group]``), the groups that differ and the tensor indices where
    they do: a strict majority is right; without one every group is suspect (fault/consistency.py's rule)."""
    ids = sorted(rows)
    positions, columns = disagreeing([[int(round(c)) for c in rows[g]] for g in ids])
    return [ids[p] for p in positions], sorted({c // CHUNKS for c in columns})


class GroupCheck:
    """``check(step)`` every ``every`` steps after a committed step: one all-reduce through the torchft Manager
    (``exchange``: SUM in place, False when it failed), one inside the group where it has several ranks."""

    def __init__(
        self,
        every: int,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        device: torch.device,
        *,
        replica_id: int,
        groups: int,
        exchange: Callable[[torch.Tensor], bool],
        participants: Callable[[], List[int]],
        group_size: int,
        start_step: int = 0,
    ):
        self.every, self.model, self.optimizer, self.device = every, model, optimizer, device
        self.replica_id, self.groups, self.group_size = replica_id, groups, group_size
        self.exchange, self.participants = exchange, participants
        self.last_good_step = start_step  # the newest step whose state every participating group agreed on
        self.unfinished = ""  # why the last check compared nothing ('' when it did)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @torch.no_grad()
    def check(self, step: int) -> Optional[GroupMismatch]:
        names, sums = state_fingerprints(self.model, self.optimizer, self.device)
        mine = to_chunks(sums).cpu()  # the one host sync, on check steps only
        rows = torch.zeros(self.groups, mine.numel(), dtype=torch.float64)
        rows[self.replica_id] = mine
        ids = self.participants()
        done = self.exchange(rows) and self.replica_id in ids
        suspects, tensors = odd_groups({g: rows[g].tolist() for g in ids}) if done else ([], [])
        suspects, done = self._agree(suspects, done)
        if not done:
            self.unfinished = "the exchange through torchft failed (a peer left)"
            return None
        self.unfinished = ""
        if not suspects:
            self.last_good_step = step
            return None
        return GroupMismatch(step, suspects, ids, [names[j] for j in tensors])

    def _agree(self, suspects: List[int], done: bool) -> tuple:
        """The union of the suspects every rank of this group found on its own shard, and whether every rank's
        exchange completed (one all-reduce inside the group, on every rank; rank i of each group saw the same rows,
        so every group reaches the same union)."""
        if self.group_size == 1:
            return suspects, done
        flags = torch.zeros(self.groups + 1, dtype=torch.int64, device=self.device)
        flags[suspects] = 1
        flags[self.groups] = int(not done)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        values = flags.tolist()
        return [g for g, f in enumerate(values[: self.groups]) if f], not values[self.groups]
