"""Replica-level fault tolerance with torchft (``fault.replica_ft=torchft``).

A replica group (``fault.replica_id``) of a torchft job is one process or one torchrun launch of k ranks holding a
full copy of the model between them (plain DP/DDP, FSDP2, TP or TP x FSDP2 inside the group;
launchers/torchft_local.sh ``--nproc-per-group``); a torchft Lighthouse forms a quorum of the live replica groups
before every step. Every rank has its own torchft Manager (rank = group rank, world = group size): group rank 0 hosts
the group's ManagerServer, which talks to the Lighthouse; the other ranks reach it through the group's store (the
torchrun rendezvous store, MASTER_ADDR:MASTER_PORT). A step:

1. ``start_step``: the quorum (synchronous; the ManagerServer waits for every rank of its group; before the job's
   first quorum, until every planned group heartbeats: fault/lighthouse_status.py). A replica group
   behind the quorum's step (a restarted one) is healed here, before its forward: its rank i fetches rank i of a
   healthy peer group's state over HTTP (``_state``: its local parameter and optimizer shards, step, data
   position, RNG; a DTensor travels as its local shard and is rebuilt on the receiver's own layout) and ``_load``
   copies it in. The data stream then follows the membership: replica r of the n participants reads slice r of a
   global batch of n x ``train.global_batch_size`` samples, its dp rank j sub-slice j (the tp ranks of one dp rank
   read the same samples; DYNAMIC membership: the global batch shrinks while a replica is down).
2. ``average``: after the group's own gradient reduction (DDP all-reduce, FSDP reduce-scatter), each rank's local
   gradients (FSDP and TP: its shards; a replicated DTensor or plain tensor whole) and the loss (the same on every tp
   rank of a dp rank), averaged over the participants through the Manager's reconfigurable gloo group: rank i
   of every group with rank i of the others (with a one-hot of the participating replica ids, summed).
3. ``should_commit``: torchft's vote, the same on every rank of a group (its ManagerServer combines the votes of
   the group's ranks: one rank's failed all-reduce stops the whole group's update); the optimizer steps only where
   every participant may. A step in which a replica dies
   fails on every peer (its all-reduce errors or times out): no replica commits it, the stream is rewound, and the
   step is redone with the next quorum, without the dead replica.
4. Every ``fault.consistency_every`` committed steps, ``exchange``: the replica check's fingerprints summed across
   the participants (fault/group_check.py, run by fault/hooks.py).

``state_dict`` (the Manager's step and ``batches_committed``) goes into each checkpoint's sidecar; a resumed group's
Manager starts from it (``manager_start_state``).

``<run>/replica_ft/membership.jsonl`` (written by group rank 0) records every change of the committed membership
and every committed step in which a participant was healed (step, replica ids, the healed ones, this replica's rank, whether it was healed from a peer, and the SHA-256 of its weights and
optimizer state as the step commits, before its update: equal on every replica of the step; with k ranks also
each rank's digest of its local shards, ``state_sha256_ranks``, and the group's digest is that of the k digests)
and every step that was redone. A healed replica's record also holds the digest of the state it had before healing
(its own initialisation or checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lmforge.checkpoint.rng import rng_state_tensors, set_rng_state_tensors
from lmforge.config.batch import BatchPlan
from lmforge.config.errors import ConfigError
from lmforge.config.fault import FaultConfig
from lmforge.data.loader import BatchStream
from lmforge.fault.consistency import local_tensor, named_state
from lmforge.fault.heal_shards import load_model_shards, load_optimizer_shards, model_shards, optimizer_shards
from lmforge.fault.lighthouse_status import wait_for_groups
from lmforge.parallel.contract import Engine
from lmforge.runtime import env_vars
from lmforge.runtime.file_modes import make_dir


def manager_start_state(saved: Optional[Dict[str, int]], step: int, say: Callable[[str], None]) -> Dict[str, int]:
    """The torchft Manager's state at start: the checkpoint's ``batches_committed`` at the trainer's step; a resumed
    checkpoint without it (saved before the Manager's state was checkpointed) starts the count at 0, said in one line.
    ``saved`` None and step 0: a fresh start."""
    if saved is None:
        if step:
            say(
                f"lmforge: note: replica_ft=torchft: the checkpoint of step {step} holds no torchft Manager state; "
                "its count of committed batches starts at 0"
            )
        return {"step": step, "batches_committed": 0}
    if int(saved.get("step", step)) != step:
        say(f"lmforge: note: replica_ft=torchft: the checkpoint's Manager step {saved['step']} is not its step {step}")
    return {"step": step, "batches_committed": int(saved["batches_committed"])}


class ReplicaFT:
    """The trainer's side of torchft: quorum and healing per step, gradient averaging, the commit vote, the record.

    ``rank``/``world_size``: this process in its replica group (the group's torch.distributed world).
    ``get_step``/``set_step`` read and set the trainer's step (a healed replica takes its peer's).
    ``manager_state``: the Manager's state saved with the checkpoint this group resumes from (``state_dict``);
    None: a fresh start, or a checkpoint saved without it (announced: its count of committed batches restarts)."""

    def __init__(
        self,
        cfg: FaultConfig,
        *,
        engine: Engine,
        data: BatchStream,
        plan: BatchPlan,
        run_dir: Path,
        rank: int,
        world_size: int,
        get_step: Callable[[], int],
        set_step: Callable[[int], None],
        manager_state: Optional[Dict[str, int]] = None,
    ):
        lighthouse = cfg.lighthouse or env_vars.read("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise ConfigError(
                "fault.lighthouse", "no torchft Lighthouse address", "set fault.lighthouse or $TORCHFT_LIGHTHOUSE"
            )
        self.cfg, self.engine, self.data, self.plan = cfg, engine, data, plan
        self.get_step, self.set_step = get_step, set_step
        self.folder = make_dir(Path(run_dir) / "replica_ft")
        self.membership_path = self.folder / "membership.jsonl"
        self.healed = False  # set by _load: this step's state came from a peer
        self.digest_before_heal = ""  # the state's digest just before _load replaced it
        self.recorded: Optional[List[int]] = None  # the last membership written
        self.consumed = 0  # the stream position before this step (a redone step rewinds to it)
        self.group_rank, self.group_size = rank, world_size
        self.rank, self.count = 0, 1
        self._members = torch.zeros(2 * cfg.replica_groups)  # one-hots: the participants, then the healed ones
        self.lighthouse = lighthouse
        self.waited = False  # the first quorum waits for every planned group (fault/lighthouse_status.py)
        self.manager = self._manager(lighthouse)
        self.manager.load_state_dict(manager_start_state(manager_state, get_step(), self._say))

    def _manager(self, lighthouse: str):
        # deferred: optional dependency (pip install lmforge[ft])
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.manager import WorldSizeMode

        timeout = timedelta(seconds=self.cfg.replica_timeout_s)
        host = socket.gethostname()  # peers reach this replica's store and manager under it
        if self.group_size > 1:  # the group's rendezvous store (torchrun's): group rank 0 posts its server there
            store_addr, store_port = env_vars.read("MASTER_ADDR", ""), int(env_vars.read("MASTER_PORT", "0"))
        else:  # a group of one process hosts its own
            self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = host, self.store.port
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=self.cfg.replica_min,
            use_async_quorum=False,  # heal before the forward, so the data slice is known when the batch is read
            # every group starts from train.seed's initialisation, so the first quorum heals nobody: a group heals
            # only when it is behind, and then all of its ranks do (torchft's step-0 sync would heal some ranks of
            # a group from one peer and not others)
            init_sync=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=self.cfg.replica_quorum_timeout_s),
            connect_timeout=timeout,
            rank=self.group_rank,
            world_size=self.group_size,
            world_size_mode=WorldSizeMode.DYNAMIC,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=f"replica_{self.cfg.replica_id}",
            hostname=host,
        )
        return manager

    # ---- what a rejoining replica fetches from a healthy peer ------------------------------------------------
    def _state(self) -> Dict[str, object]:
        """Runs on a healthy peer's quorum thread while its loop waits in ``start_step`` (a consistent state): this
        rank's local shards (fault/heal_shards.py), for the same rank of the healing group."""
        return {
            "model": model_shards(self.engine.inner),
            "optimizer": optimizer_shards(self.engine.inner, self.engine.optimizer),
            "step": self.get_step(),
            "data": self.data.state_dict(),
            "rng": rng_state_tensors(0),
        }

    def _load(self, state: Dict[str, object]) -> None:
        self.digest_before_heal = self.state_digest()
        load_model_shards(self.engine.inner, state["model"])
        load_optimizer_shards(self.engine.inner, self.engine.optimizer, state["optimizer"])
        self.data.load_state_dict(state["data"])
        set_rng_state_tensors(state["rng"], 0)
        self.set_step(int(state["step"]))
        self.healed = True

    # ---- the step ---------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """The quorum (a replica behind it is healed here), then this step's data slice."""
        self.healed = False
        if not self.waited:
            self.waited = True
            wait_for_groups(self.lighthouse, self.cfg.replica_groups, self.cfg.replica_quorum_timeout_s, self._say)
        self.manager.start_quorum()
        rank = self.manager.participating_rank()
        if rank is None:  # DYNAMIC, synchronous quorum: every group in a quorum participates
            raise RuntimeError(f"torchft returned a quorum without replica group {self.cfg.replica_id}")
        self.rank, self.count = rank, self.manager.num_participants()
        self.data.follow_replicas(self.plan, self.rank, self.count)
        self.consumed = self.data.state.consumed_samples

    def average(self, flat: torch.Tensor) -> None:
        """``flat`` averaged over the participants in place; the participating ids summed beside it."""
        self._members.zero_()
        self._members[self.cfg.replica_id] = 1.0
        self._members[self.cfg.replica_groups + self.cfg.replica_id] = float(self.healed)
        members = self.manager.allreduce(self._members, reduce_op=dist.ReduceOp.SUM)
        self.manager.allreduce(flat).wait()
        members.wait()

    def exchange(self, tensor: torch.Tensor) -> bool:
        """``tensor`` summed in place over the participants of the step just committed (rank i of each group), through
        the Manager; False when the all-reduce failed (a peer left: the next quorum reconfigures)."""
        return bool(self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM).wait()) and not self.manager.errored()

    def participants(self) -> List[int]:
        """The replica ids that participated in this step (its ``average``)."""
        return self._ids()

    def state_dict(self) -> Dict[str, int]:
        """The Manager's state (its step and the batches committed by every participant so far), for checkpoints."""
        return dict(self.manager.state_dict())

    def should_commit(self) -> bool:
        committed = self.manager.should_commit()
        if committed:
            self._record_membership()
        else:
            self.data.rewind(self.consumed)
            self._write({"step": self.get_step() + 1, "committed": False, "replicas": self._ids()})
        return committed

    def _ids(self, healed: bool = False) -> List[int]:
        """The participating replica ids of this step (``healed``: those of them healed from a peer in it)."""
        n = self.cfg.replica_groups
        flags = self._members.tolist()[n:] if healed else self._members.tolist()[:n]
        return [i for i, v in enumerate(flags) if round(v) == 1]

    def _record_membership(self) -> None:
        """On a change (the same decision on every rank of the group: the membership and the heal are the group's);
        with k ranks, a gather of their digests inside the group."""
        ids, healed = self._ids(), self._ids(healed=True)
        if ids != self.recorded or healed:  # a peer healed: the step its state is compared at
            self.recorded = ids
            record = {"step": self.get_step() + 1, "replicas": ids, "replica_rank": self.rank, "healed": self.healed}
            record["healed_replicas"] = healed
            record.update(self._group_digests(self.state_digest(), self.digest_before_heal))
            self._write(record)

    def _group_digests(self, now: str, before: str) -> Dict[str, object]:
        """This rank's state digest (and, where the group was healed, that before the heal) as the group's record:
        the digest itself in a group of one; else one gather in the group, every rank's digest under ``<key>_ranks``
        and the SHA-256 of them in rank order under ``<key>``."""
        keys = ["state_sha256", "state_sha256_before_heal"][: 2 if self.healed else 1]
        if self.group_size == 1:
            return dict(zip(keys, (now, before)))
        pairs: List[Tuple[str, str]] = [("", "")] * self.group_size
        dist.all_gather_object(pairs, (now, before))
        out: Dict[str, object] = {}
        for key, digests in zip(keys, zip(*pairs)):
            out[key] = hashlib.sha256("".join(digests).encode()).hexdigest()
            out[f"{key}_ranks"] = list(digests)
        return out

    def state_digest(self) -> str:
        """SHA-256 of this rank's parameters' and optimizer state's bytes (its local shards), by name (one host copy
        of the state: taken on membership changes only)."""
        digest = hashlib.sha256()
        for name, tensor in named_state(self.engine.inner, self.engine.optimizer):
            digest.update(name.encode())
            digest.update(local_tensor(tensor).cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def _say(self, line: str) -> None:
        if self.group_rank == 0:
            print(line, flush=True)

    def _write(self, record: dict) -> None:
        if self.group_rank != 0:  # group rank 0 writes the group's record
            return
        with open(self.membership_path, "a") as f:
            f.write(json.dumps({**record, "replica_id": self.cfg.replica_id, "time": time.time()}) + "\n")

    def close(self) -> None:
        self.manager.shutdown(wait=False)
