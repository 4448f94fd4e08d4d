"""Job-level retry budget: after a training process ends, decide finish / requeue / stop.

One decision for every launcher (slurm/train.sh via ``lmforge.launch.jobctl after``, ``lmforge launch``,
submitit jobs), recorded in ``<run>/requeues.json`` and as an event in the run's metrics JSONL:

* the run directory holds ``DONE``                      -> ``done``
* a rank's verdict is deterministic (config, layout or data error, divergence, repeated crash, corrupted
  replicas; lmforge.fault.verdict)                      -> ``stop`` with the verdict's message and exit code
* exit 2, 45, 46 or 47 without a verdict (``NEVER_RETRIED``) -> ``stop`` (deterministic; never retried)
* except silent data corruption (``corrupted``, exit 47) whose ``corrupted`` event names the suspect replica's hosts
  and whose requeue excludes every one of them (``exclusions``: lmforge.fault.bad_nodes) -> ``requeue`` within
  ``max_failures``: the checkpoints after the last agreeing check are moved to ``<run>/suspect_checkpoints/``, so
  the next run resumes from the pinned one before the corruption, on other hosts. An ambiguous finding (a pair of
  replicas, a tie: no host named) stops as above.
* preempted: the job got USR1/TERM, or exit 42, or a clean exit 0 without ``DONE`` (a preemption checkpoint
  under torchrun)                                       -> ``requeue`` (up to ``max_preemptions``)
* any other failure                                     -> ``requeue`` while ``failures <= max_failures``,
                                                           then ``stop`` ("retry budget exhausted")

Preemptions do not use the failure budget: a job may be preempted any number of times (up to the safety
limit) without losing its retries for real crashes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Mapping, Optional

from lmforge.checkpoint.layout import complete_checkpoints, is_complete, latest, step_dir, step_of
from lmforge.fault import bad_nodes
from lmforge.fault import verdict as verdicts
from lmforge.fault.events import FaultEvents
from lmforge.fault.exitcodes import (
    BAD_INPUT_EXIT_CODE,
    CORRUPTED_EXIT_CODE,
    DIVERGED_EXIT_CODE,
    REPEATED_CRASH_EXIT_CODE,
    REQUEUE_EXIT_CODE,
)
from lmforge.runtime.env_vars import slurm_job_id, slurm_restart_count
from lmforge.runtime.file_modes import write_text
from lmforge.runtime.rundir import RunPaths

STATE_FILE = "requeues.json"
SUSPECT_CHECKPOINTS = "suspect_checkpoints"  # <run>/: checkpoints that may hold corrupt weights, out of resume's way


@dataclass(frozen=True)
class Decision:
    action: str  # done | requeue | stop
    kind: str  # done | preempted | failure | budget | a deterministic verdict kind (diverged, config_error, ...)
    reason: str
    exit_code: int = 0  # what the launcher exits with on ``stop``

    def word(self, run_exit_code: int) -> str:
        """What a batch script reads: ``done``, ``requeue`` or ``stop <exit code>`` (the verdict's code, else the
        run's own, else 1)."""
        return f"stop {self.exit_code or run_exit_code or 1}" if self.action == "stop" else self.action


def _state_path(run_dir: Path) -> Path:
    return Path(run_dir) / STATE_FILE


def load_state(run_dir: Path) -> dict:
    path = _state_path(run_dir)
    if path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            pass
    return {"preemptions": 0, "failures": 0, "history": []}


def _save_state(run_dir: Path, state: dict) -> None:
    path = _state_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    write_text(tmp, json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, path)


NEVER_RETRIED = {
    BAD_INPUT_EXIT_CODE: ("bad_input", "bad input, see the error above"),
    DIVERGED_EXIT_CODE: ("diverged", "training diverged, see the 'diverged' event"),
    REPEATED_CRASH_EXIT_CODE: ("repeated_crash", "the same crash recurred, see <run>/crashes"),
    CORRUPTED_EXIT_CODE: ("corrupted", "data-parallel replicas differ, see the 'corrupted' event"),
}


def classify(
    run_dir: Path,
    exit_code: int,
    signalled: bool,
    state: dict,
    max_failures: int,
    max_preemptions: int,
    stop_at_step: Optional[int] = None,
    exclusions: Optional[Mapping[str, str]] = None,
) -> Decision:
    if RunPaths(Path(run_dir)).done_marker.exists():
        return Decision("done", "done", "the run finished (DONE marker present)")
    if stopped_as_planned(run_dir, exit_code, signalled, stop_at_step):
        return Decision(
            "done", "done", f"the run stopped at train.stop_at_step={stop_at_step} with its checkpoint (no DONE)"
        )
    verdict = verdicts.deciding(run_dir)
    corrupted = verdict.kind.value == "corrupted" if verdict is not None else exit_code == CORRUPTED_EXIT_CODE
    elsewhere = retry_elsewhere(run_dir, exclusions or {}, state, max_failures) if corrupted else None
    if elsewhere is not None:
        return elsewhere
    if verdict is not None:
        return Decision(
            "stop",
            verdict.kind.value,
            f"{verdict.summary()}; not retried (a deterministic failure, {verdicts.verdicts_dir(run_dir)})",
            verdict.exit_code,
        )
    if exit_code in NEVER_RETRIED:  # a plain srun worker's own code, when no verdict was written
        kind, why = NEVER_RETRIED[exit_code]
        return Decision("stop", kind, f"{why} (exit {exit_code}): not retried", exit_code)
    if signalled or exit_code in (0, REQUEUE_EXIT_CODE):
        if state["preemptions"] >= max_preemptions:
            return Decision(
                "stop",
                "budget",
                f"preempted {state['preemptions']} times, the limit is {max_preemptions}",
                exit_code or 1,
            )
        how = "signal received" if signalled else f"exit {exit_code} without DONE"
        return Decision("requeue", "preempted", f"preempted ({how}); resuming from the preemption checkpoint")
    if state["failures"] >= max_failures:
        return Decision(
            "stop",
            "budget",
            f"exit {exit_code}: retry budget exhausted ({state['failures']} of {max_failures} retries used)",
            exit_code or 1,
        )
    return Decision("requeue", "failure", f"exit {exit_code}: retry {state['failures'] + 1} of {max_failures}")


def last_corrupted(run_dir: Path) -> Optional[dict]:
    """The newest ``corrupted`` event of the attempt that is ending (None: none)."""
    found = [e for e in bad_nodes.attempt_events(run_dir) if e.get("event") == "corrupted"]
    return found[-1] if found else None


def retry_elsewhere(run_dir: Path, exclusions: Mapping[str, str], state: dict, max_failures: int) -> Optional[Decision]:
    """Silent data corruption whose suspect hosts are named (``corrupted`` event) and all excluded by this requeue
    (``exclusions``): a requeue on other hosts from the checkpoint before the corruption, within the failure budget.
    None: stop as any deterministic verdict (no host named, a host not excluded, or the budget spent)."""
    event = last_corrupted(run_dir)
    named = sorted(bad_nodes.corrupted_hosts(run_dir))
    if event is None or not named or not set(named) <= set(exclusions) or state["failures"] >= max_failures:
        return None
    good = int(event.get("last_good_step") or 0)
    return Decision(
        "requeue",
        "corrupted",
        f"silent data corruption at step {event.get('step')} on {','.join(named)}: requeued without "
        f"{'it' if len(named) == 1 else 'them'} (retry {state['failures'] + 1} of {max_failures}), resuming from the "
        f"newest checkpoint at or before step {good}, the last agreeing check (later ones moved to "
        f"{Path(run_dir) / SUSPECT_CHECKPOINTS})",
    )


def set_aside_after(run_dir: Path, good: int) -> List[str]:
    """Move the complete checkpoints newer than step ``good`` (they may hold corrupt weights) out of
    ``<run>/checkpoints`` into ``<run>/suspect_checkpoints``, so a resume takes the newest one at or before
    ``good``. Returns the names moved."""
    paths = RunPaths(Path(run_dir))
    dest = Path(run_dir) / SUSPECT_CHECKPOINTS
    moved = []
    for ckpt in complete_checkpoints(paths.checkpoints):
        if step_of(ckpt) > good:
            dest.mkdir(parents=True, exist_ok=True)
            os.replace(ckpt, dest / ckpt.name)
            moved.append(ckpt.name)
    return moved


def stopped_as_planned(run_dir: Path, exit_code: int, signalled: bool, stop_at_step: Optional[int]) -> bool:
    """A run given ``train.stop_at_step`` (a sweep's stable run) ends cleanly there without DONE: done, not a
    preemption, when it exited 0 unsignalled and its checkpoint at that step is complete."""
    if not stop_at_step or exit_code != 0 or signalled:
        return False
    return is_complete(step_dir(RunPaths(Path(run_dir)).checkpoints, stop_at_step))


def record(
    run_dir: Path,
    exit_code: int,
    *,
    signalled: bool,
    max_failures: int,
    max_preemptions: int = 100,
    nodes: Optional[List[str]] = None,
    exclusions: Optional[Mapping[str, str]] = None,
    stop_at_step: Optional[int] = None,
) -> Decision:
    """Classify the end of one job run, update ``requeues.json`` and emit the matching event. ``exclusions``
    (node -> why it is at fault) are recorded with a requeue: the nodes the next run is to leave out.
    ``stop_at_step``: the run's ``train.stop_at_step``, where a clean exit is done."""
    run_dir = Path(run_dir)
    state = load_state(run_dir)
    decision = classify(
        run_dir, exit_code, signalled, state, max_failures, max_preemptions, stop_at_step, exclusions=exclusions
    )
    exclusions = dict(exclusions or {}) if decision.action == "requeue" else {}
    excluded = sorted(exclusions)
    if decision.action == "requeue":
        state["preemptions" if decision.kind == "preempted" else "failures"] += 1
    entry = _entry(slurm_restart_count(), exit_code, signalled, decision.action, decision.kind, decision.reason)
    entry.update(nodes=nodes or [], excluded=excluded, exclusion_reasons=exclusions)
    if decision.kind == "corrupted" and decision.action == "requeue":
        entry["suspect_checkpoints"] = set_aside_after(run_dir, int(last_corrupted(run_dir).get("last_good_step") or 0))
    event = {"requeue": "requeue", "stop": "retry_stop"}.get(decision.action)  # done: no event
    _book(run_dir, state, entry, event, excluded=excluded)
    return decision


def _entry(slurm_restart: int, exit_code: Optional[int], signalled: bool, action: str, kind: str, reason: str) -> dict:
    """A ``requeues.json`` entry's common fields (the caller adds where the run trained and what it excludes)."""
    return {
        "time": time.time(),
        "job": slurm_job_id(),
        "slurm_restart": slurm_restart,
        "exit_code": exit_code,
        "signalled": signalled,
        "action": action,
        "kind": kind,
        "reason": reason,
    }


def _book(run_dir: Path, state: dict, entry: dict, event: Optional[str], **event_fields) -> None:
    """Append ``entry`` (with the run's verdicts) to ``requeues.json`` and emit ``event`` (None: none) at the
    newest checkpoint's step, with the run's failure and preemption counts."""
    entry["verdicts"] = [v.to_json() for v in verdicts.read_all(run_dir)]
    state["history"].append(entry)
    _save_state(run_dir, state)
    if event is not None:
        FaultEvents(RunPaths(run_dir).metrics, rank=-1).emit(
            event,
            last_step(run_dir),
            entry["reason"],
            exit_code=entry["exit_code"],
            decision=entry["kind"],
            **event_fields,
            failures=state["failures"],
            preemptions=state["preemptions"],
        )


def record_slurm_requeue(
    run_dir: Path,
    *,
    run: int,
    nodes: List[str],
    unhealthy: Mapping[str, str],
    exit_code: Optional[int] = None,
    recorded_at: str = "",
) -> Optional[dict]:
    """Record run ``run`` (0-based ``SLURM_RESTART_COUNT``) of the job as requeued by Slurm itself, when nothing
    recorded it yet. Slurm requeues a job after a node failure (or an operator's ``scontrol requeue``) and ends the
    batch script; ``jobctl after`` records it when it still runs, else the next run's prepare step does.
    ``nodes``: where that run trained; ``unhealthy``: node -> state for the nodes Slurm reports down. A node failure
    spends one retry of ``cluster.max_requeues``. Returns the entry written (None when the run was recorded)."""
    run_dir = Path(run_dir)
    state = load_state(run_dir)
    job = slurm_job_id()
    if any(h.get("job") == job and h.get("slurm_restart") == run for h in state["history"]):
        return None
    lost = {n: s for n, s in sorted(unhealthy.items()) if n in nodes}
    step = last_step(run_dir)
    if lost:
        kind = "node_failure"
        reason = (
            f"node failure: {', '.join(f'{n} is {s}' for n, s in lost.items())}; Slurm requeued run {run + 1} "
            f"itself; resuming from step {step}"
        )
        state["failures"] += 1
    else:
        kind = "slurm_requeue"
        reason = (
            f"Slurm requeued run {run + 1} itself (a node failure on a node back up since, or scontrol requeue); "
            f"resuming from step {step}"
        )
    entry = _entry(run, exit_code, True, "requeue", kind, reason)
    entry.update(nodes=sorted(nodes), lost_nodes=lost, excluded=[], exclusion_reasons={})
    entry["recorded_at"] = recorded_at or f"start of run {run + 2}"
    _book(run_dir, state, entry, "requeue", excluded=[], lost_nodes=sorted(lost))
    return entry


def annotate_last(run_dir: Path, **fields) -> None:
    """Add ``fields`` to the newest ``requeues.json`` entry (what happened after the decision: the exclusion)."""
    state = load_state(run_dir)
    if state["history"]:
        state["history"][-1].update(fields)
        _save_state(run_dir, state)


def last_step(run_dir: Path) -> int:
    ckpt = latest(RunPaths(Path(run_dir)).checkpoints)
    return step_of(ckpt) if ckpt is not None else 0
