"""Goodput: where a run's wall-clock time went, over every launch of it (``<run>/goodput.json``).

The launches' ledgers (``fault/goodput_ledger.py``: ``<run>/goodput/launch-NNN.jsonl``) are read in order and
each second between the first launch's process start and the last launch's last mark is booked to one cause:

==================  ==============================================================================================
productive          step time of the steps the run kept (less their data wait, evaluation and save stall)
startup             process start until the first step, less the checkpoint load (imports, process group, data
                    index, model build, compile's first step is productive)
checkpoint_load     the resume; replica FT: the quorum that healed the group from a peer (``hs``)
checkpoint_save     the loop's stall on saves, and the final blocking save
redone              every second of a step a later launch ran again (it resumed from an older checkpoint), and of
                    the step an exception interrupted; replica FT: a step no group committed (``u``)
evaluation          ``train.eval_every``'s evaluations
data_wait           the loop waiting for its batches
hung                the last step's end until the hang watchdog fired (its ``watchdog`` event)
restart_wait        a launch's last mark until the next launch's process started (failure detection, torchrun's
                    restart, a Slurm requeue and its time in the queue); less the hung part
reduced_membership  replica FT: the kept steps committed by fewer groups than ``fault.replica_groups`` (``r``);
                    their tokens are committed (the group did its share; the missing group's loss is in its own
                    ledger), so this is time that counts in goodput, shown apart (0 without replica FT)
profiled            steps the communication-overlap probe profiled (``metrics.profile_every``)
other               the rest of each launch's span: logging, the loop's between-step work, shutdown
==================  ==============================================================================================

``goodput`` = committed tokens / (tokens per second at full membership x wall time), where committed tokens are
the steps the run kept (replica FT: not those a heal jumped over, ``h``: its peers trained them) and the
full-membership rate is the median productive step time's. It is the same scale for
whole-job restarts and for replica fault tolerance. The steps a launch finished after its last checkpoint are
redone only when a later launch starts from that checkpoint; a launch killed with SIGKILL leaves its ledger up to
its last finished step, and the time after it falls to ``hung`` or ``restart_wait``.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from lmforge.runtime.file_modes import write_text
from lmforge.runtime.rundir import RunPaths

CAUSES = (
    "productive",
    "startup",
    "checkpoint_load",
    "checkpoint_save",
    "redone",
    "evaluation",
    "data_wait",
    "hung",
    "restart_wait",
    "reduced_membership",
    "profiled",
    "other",
)


class GoodputError(ValueError):
    """A directory with nothing to account (not a run, or no launch reached its loop)."""


@dataclass
class Launch:
    start: dict
    steps: List[dict] = field(default_factory=list)
    end: Optional[dict] = None

    @property
    def last_mark(self) -> float:
        if self.end is not None:
            return float(self.end["t"])
        return float(self.steps[-1]["t"]) if self.steps else float(self.start["loop_start"])

    @property
    def committed(self) -> List[dict]:
        """The step lines of the steps this launch committed (replica FT: not those no group committed)."""
        return [st for st in self.steps if not st.get("u")]

    @property
    def last_step(self) -> int:
        """The last step this launch finished and committed (its ledger line written)."""
        kept = self.committed
        return int(kept[-1]["s"]) if kept else int(self.start["start_step"])

    @property
    def continued_from(self) -> int:
        """The step this launch went on from: its start step, or (replica FT) the peer's step its first quorum healed
        it to (the steps before that are not run again by this launch)."""
        first = self.steps[0] if self.steps else {}
        return int(first["s"]) - 1 if "h" in first else int(self.start["start_step"])

    def unfinished_step(self, hang: Optional[dict] = None) -> Optional[dict]:
        """The step an exception or a hang interrupted, as a step line holding the seconds from the last mark to
        the end record (or to the hang's last heartbeat); None when the launch ended between steps. ``hang``: the
        watchdog event that ended this launch."""
        since = float(self.steps[-1]["t"]) if self.steps else float(self.start["loop_start"])
        if self.end is None and hang is not None and int(hang["step"]) > self.last_step:
            stuck_at = float(hang["time"]) - float(hang.get("idle_s", 0.0))
            return {"s": int(hang["step"]), "d": max(stuck_at - since, 0.0)}
        if self.end is None or int(self.end["step"]) <= self.last_step or self.end.get("reason") in ("done", "stopped"):
            return None
        seconds = float(self.end["t"]) - since - float(self.end.get("final_save_s", 0.0))
        return {"s": int(self.end["step"]), "d": max(seconds, 0.0)}


def read_ledger(path: Path) -> Optional[Launch]:
    """One launch's ledger; None when it holds no start line. A torn last line (the process died writing it) is
    ignored."""
    launch: Optional[Launch] = None
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = rec.get("kind")
        if kind == "start":
            launch = Launch(rec)
        elif launch is None:
            continue
        elif kind == "end":
            launch.end = rec
        else:
            launch.steps.append(rec)
    return launch


def read_launches(run_dir: Path) -> List[Launch]:
    paths = RunPaths(Path(run_dir))
    ledgers = sorted(paths.goodput_ledgers.glob("launch-*.jsonl"))
    launches = [x for x in map(read_ledger, ledgers) if x is not None]
    return sorted(launches, key=lambda x: float(x.start["process_start"]))


def watchdog_events(run_dir: Path) -> List[dict]:
    """The hang watchdog's events in metrics.jsonl (time, step, idle_s: the seconds since its last heartbeat),
    oldest first."""
    metrics = RunPaths(Path(run_dir)).metrics
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "event" and rec.get("event") == "watchdog" and "time" in rec:
            out.append(rec)
    return sorted(out, key=lambda rec: float(rec["time"]))


def _book_steps(
    launch: Launch,
    redo_after: Optional[int],
    causes: Dict[str, float],
    kept: List[Tuple[float, int]],
    reduced: List[Tuple[float, int]],
) -> int:
    """Book one launch's finished steps; returns how many were redone (replica FT: not committed; or a later
    launch ran them again, ``redo_after``: the step the next launch went on from; None: no next launch). ``kept``,
    ``reduced``: the kept steps' seconds and tokens, at full and at reduced membership."""
    redone = 0
    for st in launch.steps:
        heal = float(st.get("hs", 0.0))  # replica FT: the quorum that healed this group from a peer
        causes["checkpoint_load"] += heal
        d = float(st["d"]) - heal
        if st.get("u") or (redo_after is not None and int(st["s"]) > redo_after):
            causes["redone"] += d
            redone += 1
            continue
        w, e, c = max(float(st.get("w", 0.0)) - heal, 0.0), float(st.get("e", 0.0)), float(st.get("c", 0.0))
        causes["data_wait"] += w
        causes["evaluation"] += e
        causes["checkpoint_save"] += c
        rest = max(d - w - e - c, 0.0)
        tokens = int(st.get("n", launch.start["tokens_per_step"]))
        if st.get("p"):
            causes["profiled"] += rest
        elif st.get("r"):  # committed by fewer groups than fault.replica_groups: this group's share is kept
            causes["reduced_membership"] += rest
            reduced.append((rest, tokens))
        else:
            causes["productive"] += rest
            kept.append((rest, tokens))
    return redone


def _book_launch(
    launch: Launch,
    nxt: Optional[Launch],
    fired: List[dict],
    kept: List[Tuple[float, int]],
    reduced: List[Tuple[float, int]],
) -> dict:
    """One launch's seconds by cause, from its process start to the next launch's (the last: to its last mark or
    the watchdog's firing), and its summary."""
    causes = dict.fromkeys(CAUSES, 0.0)
    start = launch.start
    t_start, m = float(start["process_start"]), launch.last_mark
    load = float(start.get("load_s", 0.0))
    causes["checkpoint_load"] = load
    causes["startup"] = max(float(start["loop_start"]) - t_start - load, 0.0)
    redo_after = nxt.continued_from if nxt else None
    redone = _book_steps(launch, redo_after, causes, kept, reduced)
    gap_end = float(nxt.start["process_start"]) if nxt else max([m, *(float(ev["time"]) for ev in fired)])
    hang = None
    if launch.end is None:  # killed or hung: the first watchdog firing after its last mark is its end
        hang = next((ev for ev in fired if m < float(ev["time"]) <= gap_end), None)
    else:
        causes["checkpoint_save"] += float(launch.end.get("final_save_s", 0.0))
    unfinished = launch.unfinished_step(hang)
    if unfinished is not None and redo_after is not None and unfinished["s"] > redo_after:
        causes["redone"] += unfinished["d"]  # the step a later launch ran again (else its time stays in "other")
        redone += 1
    end = m
    if hang is not None:
        end = float(hang["time"])
        causes["hung"] = min(float(hang.get("idle_s", end - m)), end - m)  # last heartbeat -> the firing
    span = end - t_start
    causes["other"] = span - sum(causes.values())
    causes["restart_wait"] = max(gap_end - end, 0.0) if nxt else 0.0
    return {
        "launch": int(start.get("launch", 0)),
        "start_step": int(start["start_step"]),
        "last_step": launch.last_step,
        "steps": len(launch.committed),
        "redone_steps": redone,
        "ended": launch.end["reason"] if launch.end is not None else "killed (no end record)",
        "wall_s": span,
        "seconds": causes,
    }


def _committed_steps(launches: List[Launch]) -> Tuple[Dict[int, int], int]:
    """The steps the run kept and their tokens (each step's from the last launch that committed it; ``n`` where a
    batch ramp made it smaller than its launch's ``tokens_per_step``), and how many steps it skipped: replica FT's
    heals (``h``) take a group to its peer's step, and the steps between are not the group's."""
    by_step: Dict[int, int] = {}
    skipped: set = set()
    for launch in launches:  # oldest first: a redone step's line is replaced by the later launch's
        for st in launch.steps:
            if "h" in st:
                skipped.update(range(int(st["h"]) + 1, int(st["s"])))
            if not st.get("u"):
                by_step[int(st["s"])] = int(st.get("n", launch.start["tokens_per_step"]))
    first, last = int(launches[0].start["start_step"]), launches[-1].last_step
    default = int(launches[-1].start["tokens_per_step"])
    kept = {s: by_step.get(s, default) for s in range(first + 1, last + 1) if s in by_step or s not in skipped}
    return kept, len(skipped - set(by_step))


def account(run_dir: Path) -> dict:
    """The run's goodput and its wall time split by cause (see the module doc)."""
    run_dir = Path(run_dir)
    launches = read_launches(run_dir)
    if not launches:
        raise GoodputError(
            f"{run_dir}: no goodput ledger (goodput/launch-NNN.jsonl): not a run directory, or no launch of it "
            "reached its first step"
        )
    fired = watchdog_events(run_dir)
    kept: List[Tuple[float, int]] = []
    reduced: List[Tuple[float, int]] = []
    per_launch = [
        _book_launch(x, launches[i + 1] if i + 1 < len(launches) else None, fired, kept, reduced)
        for i, x in enumerate(launches)
    ]
    causes = {c: sum(x["seconds"][c] for x in per_launch) for c in CAUSES}
    last = launches[-1]
    wall = sum(causes.values())
    tokens_per_step = int(last.start["tokens_per_step"])
    committed, skipped = _committed_steps(launches)
    committed_tokens = sum(committed.values())
    kept = kept or reduced  # the full-membership rate; a group that never ran at full membership: its own
    step_s = statistics.median(d for d, _ in kept) if kept else 0.0
    if len({n for _, n in kept}) > 1:  # a batch ramp: the median rate of the kept steps, each at its own size
        full_tps = statistics.median(n / d for d, n in kept if d > 0)
    else:
        full_tps = tokens_per_step / step_s if step_s > 0 else 0.0
    return {
        "run": str(run_dir),
        "goodput": committed_tokens / (full_tps * wall) if full_tps > 0 and wall > 0 else 0.0,
        "wall_s": wall,
        "started_at": float(launches[0].start["process_start"]),
        "seconds": causes,
        "launches": len(launches),
        "ended": per_launch[-1]["ended"],
        "replicas": int(last.start.get("replicas", 0)),
        "committed_steps": len(committed),
        "redone_steps": sum(x["redone_steps"] for x in per_launch),
        "skipped_steps": skipped,
        "reduced_membership_steps": len(reduced),
        "committed_tokens": committed_tokens,
        "tokens_per_step": tokens_per_step,
        "full_membership_step_s": step_s,
        "full_membership_tokens_per_s": full_tps,
        "per_launch": per_launch,
    }


def write_goodput(run_dir: Path) -> dict:
    """Account the run, write ``<run>/goodput.json`` (whole or not at all: a temporary name, then a rename) and
    return the report."""
    paths = RunPaths(Path(run_dir))
    report = account(paths.root)
    tmp = paths.goodput.with_name(".goodput.json.tmp")
    write_text(tmp, json.dumps(report, indent=1, sort_keys=True) + "\n")
    tmp.replace(paths.goodput)
    return report


def goodput_record(report: dict, step: int) -> dict:
    """The run's accounting so far as a metrics record (``kind: "goodput"``), logged at the end of every launch:
    the dashboards' ``goodput/fraction``, ``goodput/wall_s`` and ``goodput/<cause>_s`` series (metrics/series.py)."""
    return {
        "kind": "goodput",
        "step": step,
        "fraction": report["goodput"],
        "wall_s": report["wall_s"],
        "launches": report["launches"],
        **{f"{cause}_s": seconds for cause, seconds in report["seconds"].items()},
    }


def summary_line(report: dict) -> str:
    """The one line a launch prints last: goodput and the largest losses."""
    wall = report["wall_s"]
    good = ("productive", "reduced_membership")  # reduced membership: the group's share was committed
    lost = sorted(((s, c) for c, s in report["seconds"].items() if c not in good and s > 0), reverse=True)
    parts = ", ".join(f"{c} {s:.1f} s" for s, c in lost[:3])
    return (
        f"lmforge: goodput {report['goodput']:.1%} over {report['launches']} launch(es), wall {wall:.1f} s "
        f"(productive {report['seconds']['productive']:.1f} s{'; ' + parts if parts else ''}); "
        f"table: lmforge goodput {report['run']}"
    )


def _replica_part(report: dict) -> str:
    """Replica FT's steps in the table's header: those skipped by heals, those committed at reduced membership."""
    if not report.get("replicas"):
        return ""
    return (
        f", {report['skipped_steps']} skipped (healed from a peer), {report['reduced_membership_steps']} with fewer "
        f"than {report['replicas']} groups"
    )


def format_report(report: dict) -> str:
    """The table ``lmforge goodput RUN`` prints."""
    wall = report["wall_s"]
    lines = [
        f"goodput {report['goodput']:.3f}  {report['run']}",
        f"  {report['launches']} launch(es), {report['committed_steps']} steps kept, {report['redone_steps']} "
        f"redone{_replica_part(report)}; wall {wall:.1f} s; full-membership step {report['full_membership_step_s']:.3f} s "
        f"({report['full_membership_tokens_per_s']:,.0f} tokens/s)",
    ]
    for cause in CAUSES:
        s = report["seconds"][cause]
        share = s / wall if wall > 0 else 0.0
        lines.append(f"  {cause:<19} {s:10.2f} s  {share:6.1%}")
    return "\n".join(lines)


def run_dirs(root: Path) -> List[Path]:
    """``root`` itself when it is a run (has goodput ledgers), else the runs below it (a sweep's points)."""
    root = Path(root)
    if RunPaths(root).goodput_ledgers.is_dir():
        return [root]
    return sorted({p.parent.parent for p in root.glob("**/goodput/launch-*.jsonl")})
