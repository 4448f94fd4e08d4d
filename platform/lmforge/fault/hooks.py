"""The trainer's fault hooks in one object, so the loop needs only a few calls, each named for what it does:

    faults = FaultHooks(cfg, paths, rank, device, logger, preemption, engine, start_step).start()
    faults.start_compute_clock()             # this rank's compute window opens (straggler detection)
    batches = data.step_batches()
    guard = faults.before_step(step)         # watchdog beat, before-step drills, the clock's entry mark -> loss guard
    result = engine.train_step(batches, lr, guard=guard)
    metrics = faults.after_step(step + 1, step_time)   # may run collectives; may record a stop (below)
    if faults.stop is not None: raise faults.stop      # Diverged / Corrupted: the trainer raises it, in one place
    faults.close()

The hooks never raise a fault verdict themselves: a verdict that ends training (:class:`Diverged`, :class:`Corrupted`)
is recorded in ``stop`` (the first one wins) and the trainer raises it. Drills are the exception by design: they
inject real faults (SIGKILL, an exception, a hang) where the loop would meet them.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

import torch

from lmforge.checkpoint.retention import pin_last_good, unpin
from lmforge.config.schema import RootConfig
from lmforge.fault.consistency import Mismatch, ReplicaCheck
from lmforge.fault.drills import Drills
from lmforge.fault.events import FaultEvents
from lmforge.fault.exitcodes import CORRUPTED_EXIT_CODE, DIVERGED_EXIT_CODE, WATCHDOG_EXIT_CODE
from lmforge.fault.group_check import GroupCheck, GroupMismatch
from lmforge.fault.loss_guard import LossGuard
from lmforge.fault.signals import PreemptionFlag
from lmforge.fault.straggler import ComputeClock, StragglerDetector, describe_straggler, gather_hostnames
from lmforge.fault.verdict import VerdictKind, record_exit
from lmforge.fault.watchdog import Watchdog
from lmforge.metrics.logger import MetricsLogger
from lmforge.runtime.dist import world_size
from lmforge.runtime.env_vars import slurm_restart_count, torchrun_restart_count, watched_by_launcher
from lmforge.runtime.rundir import RunPaths


class FaultStop(SystemExit):
    """Training stopped by a fault verdict a retry cannot fix: a SystemExit carrying its verdict kind
    (``fault/verdict.py`` reads ``verdict_kind`` and ``message``) and its exit code."""

    verdict_kind = ""
    exit_code = 1

    def __init__(self, message: str):
        super().__init__(self.exit_code)
        self.message = message


class Diverged(FaultStop):
    """Too many skipped steps in a row. Not retried (exit code 45, verdict ``diverged``)."""

    verdict_kind = "diverged"
    exit_code = DIVERGED_EXIT_CODE


class Corrupted(FaultStop):
    """Data-parallel replicas disagree (silent data corruption): exit code 47, verdict ``corrupted``; not retried on
    the same hosts (a Slurm requeue without the named hosts is: lmforge.fault.retry)."""

    verdict_kind = "corrupted"
    exit_code = CORRUPTED_EXIT_CODE


class FaultHooks:
    def __init__(
        self,
        cfg: RootConfig,
        paths: RunPaths,
        *,
        rank: int,
        device: torch.device,
        logger: Optional[MetricsLogger],
        preemption: PreemptionFlag,
        engine,
        start_step: int = 0,
    ):
        self.cfg = cfg
        self.paths = paths
        self.engine = engine
        self.rank = rank
        self.device = device
        self.events = FaultEvents(paths.metrics, rank, logger, jsonl=cfg.logging.jsonl)
        fc = cfg.fault
        self.watchdog = Watchdog(
            rank,
            fc.watchdog_timeout_s,
            paths.dumps,
            paths.heartbeats,
            startup_s=fc.watchdog_startup_s,
            poll_s=fc.watchdog_poll_s,
            orphan_check=fc.orphan_check and watched_by_launcher(),
            on_event=self.events.emit,
            flight_recorder=device.type == "cuda" and cfg.comm.flight_recorder_entries > 0,
            exit=self._exit,
        )
        self.stragglers = StragglerDetector(cfg.metrics.straggler_every, cfg.metrics.straggler_threshold, device)
        self.clock = ComputeClock(device) if cfg.metrics.straggler_every > 0 else None
        self.loss_guard = (
            LossGuard(fc.spike_factor, fc.spike_window, fc.max_consecutive_skips) if fc.loss_guard else None
        )
        self.drills = Drills(
            fc.drill,
            rank,
            paths.root / "drills",
            self.events.emit,
            self.watchdog.pause,
            stop_requested=lambda: preemption.requested,
            parameters=lambda: engine.inner.named_parameters(),
            replica=fc.replica_id if fc.replica_ft == "torchft" else None,
        )
        self.start_step = start_step  # the step this launch resumes from (0: a fresh start)
        self.replicas = self._replica_check(engine, start_step)
        self.groups: Optional[GroupCheck] = None  # fault.replica_ft=torchft: the check across groups (compare_groups)
        self.last_straggler: dict = {}
        self.hosts: list = []  # every rank's host name, by rank (``start``; this group's ranks under torchft)
        self.stop: Optional[FaultStop] = None  # the verdict that ends training, raised by the trainer
        self._held = None

    def _exit(self, code: int) -> None:
        """The watchdog's exit: a hang leaves its (retryable) verdict first."""
        if code == WATCHDOG_EXIT_CODE:
            record_exit(
                self.paths.root,
                VerdictKind.HANG,
                self.rank,
                self.watchdog.step,
                f"no heartbeat for {self.watchdog.allowance():.0f}s after step {self.watchdog.step} "
                f"(stacks in {self.paths.dumps})",
                code,
            )
        os._exit(code)

    def _replica_check(self, engine, start_step: int) -> Optional[ReplicaCheck]:
        """The replica consistency check, or None (announced when a multi-rank run has nothing to compare)."""
        every = self.cfg.fault.consistency_every
        if every <= 0:
            return None
        group = engine.replica_group  # the ranks holding a replica of this shard; None: none (parallel/contract.py)
        torchft = self.cfg.fault.replica_ft == "torchft"
        if group is None:
            if self.rank == 0 and (world_size() > 1 or torchft):
                why = (
                    "parallelism.dp_replicate=1: no rank holds a replica of another's shard"
                    if self.cfg.parallelism.engine == "native"
                    else f"the {self.cfg.parallelism.engine} engine "
                    "shards the optimizer state across data-parallel ranks"
                )
                if torchft:  # the groups are compared with each other instead (compare_groups)
                    print(
                        f"lmforge: note: fault.consistency_every={every} compares the torchft replica groups with "
                        f"each other (fault/group_check.py); no replica inside this group to compare ({why})",
                        flush=True,
                    )
                    return None
                print(
                    f"lmforge: note: fault.consistency_every={every} compares nothing in this layout ({why}); "
                    "use dp_replicate >= 2 (HSDP) to have replicas checked",
                    flush=True,
                )
            return None
        return ReplicaCheck(every, engine.inner, engine.optimizer, group, self.device, start_step)

    def compare_groups(self, replica_ft, group_size: int) -> None:
        """fault.replica_ft=torchft and fault.consistency_every > 0: compare this group's state with the other
        replica groups' through ``replica_ft`` (a fault.replica_ft.ReplicaFT) after every due committed step."""
        fc = self.cfg.fault
        if fc.consistency_every <= 0:
            return
        self.groups = GroupCheck(
            fc.consistency_every,
            self.engine.inner,
            self.engine.optimizer,
            self.device,
            replica_id=fc.replica_id,
            groups=fc.replica_groups,
            exchange=replica_ft.exchange,
            participants=replica_ft.participants,
            group_size=group_size,
            start_step=self.start_step,
        )

    def start(self) -> "FaultHooks":
        """Attach the compute clock, start the watchdog, gather every rank's host name for the straggler and
        ``corrupted`` events (collective: one all_gather, on every rank, only with ``metrics.straggler_every`` > 0
        or ``fault.consistency_every`` > 0, and more than one rank; under torchft the ranks of this group) and
        record a restart (its step: the step this launch resumes from)."""
        if self.clock is not None:
            self.clock.attach(self.engine, self.cfg.parallelism)
        self.watchdog.start()
        self.watchdog.write_heartbeat()
        if self.stragglers.every > 0 or self.cfg.fault.consistency_every > 0:
            self.hosts = self.stragglers.hosts = gather_hostnames(self.device)
        restart, requeue = torchrun_restart_count(), slurm_restart_count()
        # Every restarted rank reports (an agent that rejoined for a peer's restart may still count 0).
        if restart or (requeue and self.rank == 0):
            self.events.emit(
                "restart",
                self.start_step,
                f"torchrun restart {restart}, Slurm requeue {requeue}",
                torchrun_restart=restart,
                slurm_restart=requeue,
            )
        return self

    def start_compute_clock(self) -> None:
        """The top of the loop: the previous step's collectives are behind; this rank's compute time starts."""
        if self.clock is not None:
            self.clock.begin()

    def before_step(self, step: int) -> Optional[LossGuard]:
        """Right before ``train_step`` for step ``step + 1`` (its batches are loaded): the before-step drills
        (``slow_s``), the compute clock's entry mark and a watchdog beat. No collective.

        Returns the engine's loss guard for that step (None: the guard is off)."""
        self.drills.before_step(step + 1)
        if self.clock is not None:
            self.clock.entering_step()
        self.watchdog.beat(step)
        if self.loss_guard is None:
            return None
        self.loss_guard.step = step + 1
        return self.loss_guard

    def after_step(self, step: int, step_time_s: float) -> dict:
        """After step ``step``, in this order: a watchdog beat, the compute clock's end, the loss guard's readable
        verdicts (skipped-step events, the pin of the last good checkpoint; divergence), the straggler gather
        (collective: ``all_gather`` every ``metrics.straggler_every`` steps), the after-step drills (sleep,
        SIGKILL, an exception, a hang, a bit flip), the replica check (collectives: ``all_gather`` over the replica
        group + ``all_reduce`` over the world every ``fault.consistency_every`` steps), the check across torchft
        replica groups (the Manager's all-reduce, one inside a multi-rank group; ``compare_groups``), a watchdog beat.
        Returns extra metrics. A verdict that ends training is left in ``stop`` and the rest is skipped.

        The loss guard's verdicts are booked as they become readable on the host: at once on the CPU, a step
        late at most on a GPU (see ``fault/loss_guard.py``), so the accounting never stalls the device.
        """
        self.watchdog.beat(step)
        if self.clock is not None:
            self.clock.end()
        extra: dict = {}
        if self.loss_guard is not None:
            self.book_verdicts(force=False)
            if self.stop is not None:
                return extra
            extra["skipped_steps"] = self.loss_guard.skipped_total
        found = self.stragglers.observe(step, step_time_s, self.clock)
        if found is not None:
            slowest = max(range(len(found["times"])), key=lambda r: found["times"][r])
            ref = found["references"][slowest]
            extra["compute_time_max_over_median"] = found["times"][slowest] / ref if ref else 1.0
            if self.rank == 0:
                mode = self.clock.mode if self.clock is not None else "wall step time"
                s = self.stragglers
                for r in found["stragglers"]:  # the line leads with the slow rank and its host, not the reporter
                    host = s.host(r)
                    cause, fields = describe_straggler(
                        found, r, host=host, threshold=s.threshold, every=s.every, mode=mode
                    )
                    self.events.emit("straggler", step, cause, rank=r, host=host, **fields)
            self.last_straggler = found
        self.drills.after_step(step)
        if self.replicas is not None and self.replicas.due(step):
            t0 = time.perf_counter()
            mismatch = self.replicas.check(step)
            if mismatch is not None:
                self.stop = self.corrupted(mismatch)
                return extra
            extra["replica_check_s"] = time.perf_counter() - t0
        if self.groups is not None and self.groups.due(step):
            t0 = time.perf_counter()
            self._compare_groups(step, extra)
            extra["replica_group_check_s"] = time.perf_counter() - t0
        self.watchdog.beat(step)
        return extra

    def _compare_groups(self, step: int, extra: dict) -> None:
        """The check across torchft replica groups: a suspect group stops (``stop``), the others record the event."""
        found = self.groups.check(step)  # collectives: the Manager's all-reduce; one inside a multi-rank group
        if self.groups.unfinished:
            if self.rank == 0:
                print(
                    f"lmforge: warning: step {step}: replica groups not compared: {self.groups.unfinished}", flush=True
                )
            return
        extra["replica_groups_compared"] = len(self.groups.participants())
        if found is None:
            return
        here = self.cfg.fault.replica_id in found.suspects
        if self.rank == 0:
            self.events.emit(
                "replica_mismatch",
                step,
                found.describe(),
                replica_groups=found.suspects,
                participants=found.participants,
                tensors=found.tensors,
                last_good_step=self.groups.last_good_step,
                this_group_suspect=here,
            )
        if here:
            self.stop = self.corrupted_group(found)

    def book_verdicts(self, force: bool = True) -> None:
        """Events, the pin of the last good checkpoint and the divergence verdict (into ``stop``), for every
        readable loss-guard verdict. ``force`` reads all of them (before a checkpoint is written and at the end of
        training). No collective: every rank holds the same verdicts (from the step's global loss)."""
        g = self.loss_guard
        if g is None or self.stop is not None:
            return
        for verdict in g.resolve(force=force):
            if not verdict.skipped:
                if self._held is not None:
                    self._release_held()
                continue
            if g.consecutive == 1:
                self._hold_last_good(verdict.step)
            self.events.emit(
                "skipped_step", verdict.step, verdict.cause, skipped_total=g.skipped_total, consecutive=g.consecutive
            )
            if g.diverged:
                self.stop = self.diverged(verdict.step)
                return

    def _hold_last_good(self, step: int) -> None:
        """A skip streak starts: pin the newest checkpoint, so saves during the streak cannot retire it."""
        self._held = pin_last_good(
            self.paths.checkpoints, f"loss guard: newest checkpoint before the skipped step {step}", unless_pinned=True
        )

    def _release_held(self) -> None:
        if self._held is not None:
            unpin(self._held)
        self._held = None

    def diverged(self, step: int) -> Diverged:
        """Too many skips in a row: pin the last checkpoint before the first one, record the event."""
        g = self.loss_guard
        first_bad = g.first_bad_step or step
        ref = pin_last_good(
            self.paths.checkpoints, f"last checkpoint before divergence at step {first_bad}", at_or_before=first_bad - 1
        )
        if ref is not None:
            where = f"resume from {ref} (pinned) with a lower optim.lr or a fixed data source"
        else:
            where = "no checkpoint precedes the divergence; restart with a lower optim.lr"
        msg = (
            f"training diverged: {g.consecutive} skipped steps in a row since step {first_bad} "
            f"(last cause: {g.last_cause}); {where}"
        )
        self.events.emit("diverged", step, msg, checkpoint=str(ref) if ref else None, first_bad_step=first_bad)
        return Diverged(msg)

    def corrupted(self, mismatch: Mismatch) -> Corrupted:
        """Replicas disagree: name them, pin the newest checkpoint from before the corruption, exit 47.

        A checkpoint taken after the last agreeing check may already hold the corrupt weights, so the reference
        is the newest one at or before that check (nothing new is saved)."""
        good = self.replicas.last_good_step
        ref, where = self._last_good_reference(mismatch.step, good)
        ranks = ", ".join(map(str, mismatch.suspects))
        hosts = self.hosts_of(mismatch.certain)
        if mismatch.tensors and self.rank == min(r for r in mismatch.group if r in mismatch.suspects):
            self.events.emit(
                "replica_mismatch",
                mismatch.step,
                mismatch.describe(),
                ranks=mismatch.suspects,
                replicas=mismatch.group,
                tensors=mismatch.tensors,
                last_good_step=good,
            )
        on = (
            f" on host(s) {', '.join(hosts)}"
            if hosts
            else " (no majority: no host can be named, none is excluded)"
            if not mismatch.certain
            else ""
        )
        msg = (
            f"silent data corruption: data-parallel replicas differ at step {mismatch.step} (last agreeing check "
            f"at step {good}); suspect rank(s) {ranks}{on}; check their GPUs/hosts and exclude them, then {where}"
        )
        return self._announce_corrupted(mismatch.step, msg, ranks=mismatch.suspects, hosts=hosts, ref=ref, good=good)

    def hosts_of(self, ranks) -> list:
        """The distinct host names of ``ranks`` (``start`` gathered them; [] for ranks it did not)."""
        return sorted({self.hosts[r] for r in ranks if 0 <= r < len(self.hosts)})

    def _last_good_reference(self, found_step: int, good: int) -> tuple:
        """Pin the newest checkpoint at or before the last agreeing check ``good``; (its path or None, what to do)."""
        ref = pin_last_good(
            self.paths.checkpoints,
            f"last checkpoint before the replica mismatch found at step {found_step}",
            at_or_before=good,
        )
        if ref is not None:
            return ref, (
                f"resume from {ref} (pinned; checkpoints after step {good} may hold corrupt weights) with "
                f"train.resume={ref}"
            )
        return None, f"no checkpoint precedes step {good}; restart from scratch"

    def corrupted_group(self, found: GroupMismatch) -> Corrupted:
        """This torchft replica group's state differs from its peers' (or no majority tells which is right): name
        the group(s), pin the newest checkpoint from before, exit 47. Under lmforge.launch.replica_ft the group is
        started again and, behind its peers, heals from a healthy one at its first quorum."""
        good = self.groups.last_good_step
        ref, where = self._last_good_reference(found.step, good)
        me = self.cfg.fault.replica_id
        hosts = [] if found.ambiguous else sorted(set(self.hosts))  # the suspect group's: this group's ranks
        if found.ambiguous:
            who = f"replica groups {found.participants} disagree and no majority tells which is right"
            then = f"check the hosts of every group (none is excluded: no host can be named), then {where}"
        else:
            others = [g for g in found.participants if g not in found.suspects]
            who = f"replica group {me}'s state differs from groups {others} (its host(s): {', '.join(hosts)})"
            then = (
                f"check its GPUs/hosts; restarted (lmforge.launch.replica_ft), it heals from a healthy peer; alone, "
                f"{where}"
            )
        msg = f"silent data corruption at step {found.step} (last agreeing check at step {good}): {who}; {then}"
        return self._announce_corrupted(found.step, msg, replica_groups=found.suspects, hosts=hosts, ref=ref, good=good)

    def _announce_corrupted(self, step: int, msg: str, *, ref, good: int, **suspects) -> Corrupted:
        """One ``corrupted`` event in the metrics (rank 0: the suspects, their hosts, the pinned checkpoint, the
        last agreeing check); every other rank's log gets the line. Returns the exception that stops the run."""
        if self.rank == 0:
            self.events.emit(
                "corrupted", step, msg, **suspects, checkpoint=str(ref) if ref else None, last_good_step=good
            )
        else:
            print(f"[lmforge fault] corrupted rank={self.rank} step={step}: {msg}", file=sys.stderr, flush=True)
        return Corrupted(msg)

    def close(self) -> None:
        if self.clock is not None:
            self.clock.detach()
        self.watchdog.stop()
