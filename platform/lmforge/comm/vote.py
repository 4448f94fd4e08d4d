"""Agree across ranks on a yes/no question every step without a blocking collective every step.

Two questions are asked after every step: "did any rank get a preemption signal?" (``any``: the trainer
stops) and "has every rank finished writing the async checkpoint?" (``all``: the checkpoint manager
commits it). A signal or a finished write reaches the ranks at slightly different times, so the ranks
must agree on the step at which they act. A blocking ``all_reduce`` + ``item()`` after every step would stall
the GPU at every step boundary. Instead each rank casts its flag as an asynchronous all-reduce (MAX for
``any``, MIN for ``all``) after step ``s`` and reads the result after step ``s + 1``: every rank reads the same
collective at the same step, so they still act together, one step later than a blocking vote.

On a GPU the result is staged to the host with :class:`HostCopy` right behind the collective on the stream;
reading it a step later waits only until the GPU has finished step ``s``. With one rank there is nothing to
agree on: the local flag is the answer, at once.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from lmforge.runtime.host_copy import HostCopy


class LaggedVote:
    def __init__(self, device: torch.device, mode: str = "any", group: Optional[dist.ProcessGroup] = None):
        if mode not in ("any", "all"):
            raise ValueError(f"LaggedVote mode must be 'any' or 'all', got {mode!r}")
        self.device = device
        self.op = dist.ReduceOp.MAX if mode == "any" else dist.ReduceOp.MIN
        self.group = group
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._pending: Optional[Tuple[Optional[dist.Work], Union[HostCopy, torch.Tensor]]] = None

    def exchange(self, flag: bool) -> bool:
        """Cast this rank's flag for the step just finished; return the agreed flag of the previous cast.

        Once the answer is yes no new vote is cast (every rank read the same yes): the next call starts afresh."""
        if self.world == 1:
            return flag
        agreed = self.collect()
        if agreed:  # every rank read the same result: all act here, and none casts another vote
            return True
        vote = torch.full((1,), 1.0 if flag else 0.0, device=self.device)  # a fill kernel: no host-to-device sync
        work = dist.all_reduce(vote, op=self.op, group=self.group, async_op=True)
        if self.device.type == "cuda":
            work.wait()  # orders the stream after the collective; does not block the host
            self._pending = (None, HostCopy(vote))
        else:
            self._pending = (work, vote)  # CPU: the collective fills ``vote`` in the background; read after wait()
        return agreed

    def collect(self) -> bool:
        """The agreed flag of the last cast (False if none is outstanding); waits for that collective only.
        Also discards an outstanding vote (every rank must call it at the same point)."""
        if self._pending is None:
            return False
        work, result = self._pending
        self._pending = None
        if work is not None:
            work.wait()
            result = HostCopy(result)
        return result.values()[0] > 0
