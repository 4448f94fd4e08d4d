"""Replica-level fault tolerance with torchft (``fault.replica_ft=torchft``).

Every process is one replica group (``fault.replica_id``) of a torchft job; a torchft Lighthouse
(launchers/torchft_local.sh starts it) forms a quorum of the live replica groups before every step. A step:

1. ``start_step``: the quorum (synchronous). A replica group behind the quorum's step (a restarted one) is healed
   here, before its forward: torchft fetches a healthy peer's state over HTTP (``_state``: weights, optimizer,
   step, data position, RNG) and ``_load`` applies it. The data stream then follows the membership: replica r of
   the n participants reads slice r of a global batch of n x ``train.global_batch_size`` samples (DYNAMIC
   membership: the global batch shrinks while a replica is down).
2. ``average``: the engine's gradients and loss, averaged over the participants through the Manager's
   reconfigurable gloo group (with a one-hot of the participating replica ids, summed, for the record).
3. ``should_commit``: torchft's vote; the optimizer steps only where every participant may. A step in which a
   replica dies fails on every peer (its all-reduce errors or times out): no replica commits it, the stream is
   rewound, and the step is redone with the next quorum, without the dead replica.

``<run>/replica_ft/membership.jsonl`` records every change of the committed membership (step, replica ids, this
replica's rank, whether it was healed from a peer, and the SHA-256 of its weights and optimizer state as the step
commits, before its update: equal on every replica of the step) and every step that was redone. A healed replica's
record also holds the digest of the state it had before healing (its own initialisation or checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from lmforge.checkpoint.rng import rng_state_tensors, set_rng_state_tensors
from lmforge.config.batch import BatchPlan
from lmforge.config.errors import ConfigError
from lmforge.config.fault import FaultConfig
from lmforge.data.loader import BatchStream
from lmforge.fault.consistency import local_tensor, named_state
from lmforge.parallel.contract import Engine
from lmforge.runtime import env_vars
from lmforge.runtime.file_modes import make_dir


class ReplicaFT:
    """The trainer's side of torchft: quorum and healing per step, gradient averaging, the commit vote, the record.

    ``get_step``/``set_step`` read and set the trainer's step (a healed replica takes its peer's)."""

    def __init__(
        self,
        cfg: FaultConfig,
        *,
        engine: Engine,
        data: BatchStream,
        plan: BatchPlan,
        run_dir: Path,
        world_size: int,
        get_step: Callable[[], int],
        set_step: Callable[[int], None],
    ):
        if world_size != 1:
            raise ConfigError(
                "fault.replica_ft",
                f"each torchft replica group is one process; this one was launched with a world of {world_size}",
                "start replica groups with launchers/torchft_local.sh (one process each)",
            )
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
        self.rank, self.count = 0, 1
        self._members = torch.zeros(cfg.replica_groups)
        self.manager = self._manager(lighthouse)

    def _manager(self, lighthouse: str):
        # deferred: optional dependency (pip install lmforge[ft])
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.manager import WorldSizeMode

        timeout = timedelta(seconds=self.cfg.replica_timeout_s)
        host = socket.gethostname()  # peers reach this replica's store and manager under it
        self.store = TCPStore(host, 0, is_master=True, wait_for_workers=False)  # the group's store (world of one)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=self.cfg.replica_min,
            use_async_quorum=False,  # heal before the forward, so the data slice is known when the batch is read
            timeout=timeout,
            quorum_timeout=timedelta(seconds=self.cfg.replica_quorum_timeout_s),
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            world_size_mode=WorldSizeMode.DYNAMIC,
            store_addr=host,
            store_port=self.store.port,
            lighthouse_addr=lighthouse,
            replica_id=f"replica_{self.cfg.replica_id}",
            hostname=host,
        )
        manager.load_state_dict({"step": self.get_step(), "batches_committed": 0})  # a resumed replica's step
        return manager

    # ---- what a rejoining replica fetches from a healthy peer ------------------------------------------------
    def _state(self) -> Dict[str, object]:
        """Runs on a healthy peer's quorum thread while its loop waits in ``start_step`` (a consistent state)."""
        return {
            "model": self.engine.inner.state_dict(),
            "optimizer": self.engine.optimizer.state_dict(),
            "step": self.get_step(),
            "data": self.data.state_dict(),
            "rng": rng_state_tensors(0),
        }

    def _load(self, state: Dict[str, object]) -> None:
        self.digest_before_heal = self.state_digest()
        self.engine.inner.load_state_dict(state["model"])
        self.engine.optimizer.load_state_dict(state["optimizer"])
        self.data.load_state_dict(state["data"])
        set_rng_state_tensors(state["rng"], 0)
        self.set_step(int(state["step"]))
        self.healed = True

    # ---- the step ---------------------------------------------------------------------------------------
    def start_step(self) -> None:
        """The quorum (a replica behind it is healed here), then this step's data slice."""
        self.healed = False
        self.manager.start_quorum()
        rank = self.manager.participating_rank()
        if rank is None:  # DYNAMIC, synchronous quorum: every group in a quorum participates
            raise RuntimeError(f"torchft returned a quorum without replica group {self.cfg.replica_id}")
        self.rank, self.count = rank, self.manager.num_participants()
        self.data.follow_replicas(self.plan, self.rank, self.count)
        self.consumed = self.data.state.consumed_samples

    def average(self, flat: torch.Tensor) -> None:
        """``flat`` averaged over the participants in place; the participating ids summed beside it."""
        # deferred: optional dependency
        from torch.distributed import ReduceOp

        self._members.zero_()
        self._members[self.cfg.replica_id] = 1.0
        members = self.manager.allreduce(self._members, reduce_op=ReduceOp.SUM)
        self.manager.allreduce(flat).wait()
        members.wait()

    def should_commit(self) -> bool:
        committed = self.manager.should_commit()
        if committed:
            self._record_membership()
        else:
            self.data.rewind(self.consumed)
            self._write({"step": self.get_step() + 1, "committed": False, "replicas": self._ids()})
        return committed

    def _ids(self) -> List[int]:
        return [i for i, v in enumerate(self._members.tolist()) if round(v) == 1]

    def _record_membership(self) -> None:
        ids = self._ids()
        if ids != self.recorded or self.healed:
            self.recorded = ids
            record = {"step": self.get_step() + 1, "replicas": ids, "replica_rank": self.rank, "healed": self.healed}
            record["state_sha256"] = self.state_digest()
            if self.healed:
                record["state_sha256_before_heal"] = self.digest_before_heal
            self._write(record)

    def state_digest(self) -> str:
        """SHA-256 of the parameters' and optimizer state's bytes, by name (one host copy of the state: taken on
        membership changes only)."""
        digest = hashlib.sha256()
        for name, tensor in named_state(self.engine.inner, self.engine.optimizer):
            digest.update(name.encode())
            digest.update(local_tensor(tensor).cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def _write(self, record: dict) -> None:
        with open(self.membership_path, "a") as f:
            f.write(json.dumps({**record, "replica_id": self.cfg.replica_id, "time": time.time()}) + "\n")

    def close(self) -> None:
        self.manager.shutdown(wait=False)
