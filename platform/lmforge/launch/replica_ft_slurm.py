"""A torchft job on Slurm (``fault.replica_ft=torchft``): the Lighthouse and every replica group as Slurm jobs,
supervised; a group whose job fails is resubmitted without the node at fault.

    slurm/torchft_supervisor.sh --replicas 2 --name ft-demo -- model=tiny train.max_steps=50
    python -m lmforge.launch.replica_ft_slurm --replicas 2 --name ft-demo --dry-run -- model=tiny

Runs where sbatch does (a login node, in tmux, or as a small job of its own). It submits:

* the Lighthouse: ``slurm/torchft_lighthouse.sh`` (``torchft_lighthouse`` bound to --port on all addresses), one
  task on one node (--lighthouse-node pins it, e.g. to a service node); the supervisor waits until it runs;
* replica group i: ``slurm/train.sh`` with ``run.name=<name>/replica-<i>``, the ``fault.replica_*`` keys and
  ``fault.lighthouse=http://<the Lighthouse's node>:<port>``, on --nodes-per-group nodes, ``--no-requeue`` and
  ``cluster.max_requeues=0`` (the supervisor owns every resubmission) and ``--exclude`` = the Lighthouse's node
  plus every node excluded so far: a node failure takes out one group or the Lighthouse, never both.

Then it polls the jobs (squeue; an ended job's exit code from scontrol, else sacct) every --poll-s seconds. A
group's job that ends COMPLETED with train.sh's ``done`` in the group's requeues.json is finished. Any other end
(NODE_FAIL, FAILED, TIMEOUT, OUT_OF_MEMORY, PREEMPTED, BOOT_FAIL, or COMPLETED without ``done``) resubmits the group,
at most --max-resubmits times, excluding the node at fault: after NODE_FAIL the job's nodes that Slurm reports down
(all its nodes if none is reported), after another failure only those Slurm reports unhealthy; and the hosts
lmforge.fault.bad_nodes names from the group's run directory (a group whose state was found corrupt). Never resubmitted:
exit code 2 (a config error that would recur) and CANCELLED (someone cancelled it); once groups are given up and
fewer than --min-replicas are left, every job is cancelled (those left could never commit). The new job heals from a
healthy peer (lmforge.fault.replica_ft). When the Lighthouse's job ends, the run cannot form quorums: every job is
cancelled and the supervisor exits 1.

The record, ``<run.root>/<name>/replica_ft/supervisor.jsonl``: one JSON line per submission (role, replica,
attempt, job, exclude, the sbatch command), job start (nodes), job end (state, exit code, nodes), exclusion (node,
reason) and the supervisor's exit; the jobs' logs beside it (``lighthouse-<job>.out``,
``replica-<i>-<job>.out``/``.err``); at the exit ``<name>/goodput.json``, the job's goodput over its groups
(fault/goodput_job.py, as the local launcher writes it). Exit 0 once every group finished, else the first given-up group's exit code
(1 if it had none); SIGTERM or SIGINT cancels every job. If the supervisor itself dies (its machine reboots), the
jobs run on unsupervised: cancel them (job names ``<name>-lighthouse``, ``<name>-r<i>``) before starting it again. Bad input (a minority --min-replicas, fewer usable nodes than
groups x --nodes-per-group + 1 for the Lighthouse) fails in one line, exit 2, before anything is submitted.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from lmforge.fault import bad_nodes
from lmforge.fault.goodput_job import announce_job_goodput
from lmforge.launch import slurm_queue
from lmforge.launch.replica_ft import CONFIG_ERROR, OneLineParser, majority_or_refuse, run_root
from lmforge.runtime import env_vars

REPO = Path(env_vars.read("LMFORGE_REPO") or Path(__file__).resolve().parents[3])
EXPORT = f"--export=ALL,LMFORGE_REPO={REPO}"  # the jobs' scripts find this checkout (slurm/env.sh)
NOT_RESUBMITTED = "CANCELLED"  # a person cancelled the job: respected


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = OneLineParser(
        prog="torchft_supervisor.sh", description=__doc__.split("\n")[0], script="slurm/torchft_supervisor.sh"
    )
    p.add_argument("--replicas", type=int, required=True, help="replica groups (one Slurm job each)")
    p.add_argument("--min-replicas", type=int, help="a step commits with at least this many (default: a majority)")
    p.add_argument("--nodes-per-group", type=int, default=1, help="nodes of each group's job")
    p.add_argument("--max-resubmits", type=int, default=3, help="resubmissions of each group")
    p.add_argument("--name", default=f"torchft-{time.strftime('%Y%m%d-%H%M%S')}", help="the run's name in run.root")
    p.add_argument("--port", type=int, default=29510, help="the Lighthouse's port")
    p.add_argument("--lighthouse-node", default="", help="run the Lighthouse on this node (default: Slurm's choice)")
    p.add_argument("--exclude", default="", help="nodes no job may use (comma-separated Slurm names)")
    p.add_argument("--join-timeout-ms", type=int, default=30000, help="the Lighthouse's (above a step's time)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="a silent group is dead after this")
    p.add_argument("--sbatch-arg", action="append", default=[], help="an sbatch option for every group's job")
    p.add_argument("--poll-s", type=float, default=2.0, help="seconds between two reads of the jobs' states")
    p.add_argument("--lighthouse-wait-s", type=float, default=600.0, help="give up when the Lighthouse waits longer")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch commands, submit nothing")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for every replica group (after --)")
    args = p.parse_args(argv)
    majority_or_refuse(p, args)
    for flag in ("nodes_per_group", "port"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at least 1")
    if args.max_resubmits < 0:
        p.error(f"--max-resubmits {args.max_resubmits} must be at least 0")
    args.exclude = sorted(filter(None, args.exclude.split(",")))
    return args


def lighthouse_sbatch(args: argparse.Namespace, folder: Path) -> List[str]:
    where = [f"--nodelist={args.lighthouse_node}"] if args.lighthouse_node else []
    where += [f"--exclude={','.join(args.exclude)}"] if args.exclude else []
    return [
        f"--job-name={args.name}-lighthouse",
        "--nodes=1",
        "--ntasks=1",
        "--no-requeue",
        EXPORT,
        *where,
        f"--output={folder}/lighthouse-%j.out",
        f"--error={folder}/lighthouse-%j.out",
        str(REPO / "slurm" / "torchft_lighthouse.sh"),
        "--min_replicas",
        str(args.min_replicas),
        "--bind",
        f"0.0.0.0:{args.port}",
        "--join_timeout_ms",
        str(args.join_timeout_ms),
        "--heartbeat_timeout_ms",
        str(args.heartbeat_timeout_ms),
    ]


def group_sbatch(args: argparse.Namespace, folder: Path, i: int, lighthouse: str, exclude: Sequence[str]) -> List[str]:
    return [
        f"--job-name={args.name}-r{i}",
        f"--nodes={args.nodes_per_group}",
        "--ntasks-per-node=1",
        "--no-requeue",
        EXPORT,
        *([f"--exclude={','.join(exclude)}"] if exclude else []),
        f"--output={folder}/replica-{i}-%j.out",
        f"--error={folder}/replica-{i}-%j.err",
        *args.sbatch_arg,
        str(REPO / "slurm" / "train.sh"),
        *args.overrides,
        f"run.name={args.name}/replica-{i}",
        "fault.replica_ft=torchft",
        f"fault.replica_groups={args.replicas}",
        f"fault.replica_id={i}",
        f"fault.replica_min={args.min_replicas}",
        f"fault.lighthouse=http://{lighthouse}:{args.port}",
        "cluster.max_requeues=0",
    ]


def finished(run_dir: Path, job: str) -> bool:
    """train.sh's jobctl decided ``done`` at the end of ``job`` (requeues.json): the group trained to its end."""
    try:
        history = json.loads((run_dir / "requeues.json").read_text())["history"]
    except (OSError, ValueError, KeyError):
        return False
    return any(str(h.get("job")) == job and h.get("action") == "done" for h in history)


def nodes_at_fault(end: slurm_queue.JobState, down: Dict[str, str], run_dir: Path) -> Dict[str, str]:
    """node -> why, for the nodes of the ended job ``end``: those Slurm reports unhealthy (``down``: node -> state;
    after NODE_FAIL with none reported, all of its nodes) and those lmforge.fault.bad_nodes names from the group's run
    directory (silent data corruption on the group's state, a group that exited 47 with its hosts named)."""
    reasons = {n: f"job {end.job} ended {end.state}; Slurm reports {n} {s}" for n, s in down.items()}
    if not down and end.state == "NODE_FAIL":
        reasons = {n: f"job {end.job} ended NODE_FAIL on it" for n in end.nodes}
    for node, why in bad_nodes.at_fault(run_dir, end.nodes, {}, straggler_limit=0).items():
        reasons.setdefault(node, f"job {end.job} ended {end.state} (exit {end.exit_code}); {why}")
    return reasons


@dataclass
class Group:
    replica: int
    job: str = ""
    attempt: int = 0
    started: bool = False
    final_rc: Optional[int] = None  # set once the group is not resubmitted again


@dataclass
class Supervisor:
    args: argparse.Namespace
    folder: Path = field(init=False)
    groups: Dict[int, Group] = field(init=False)
    excluded: Dict[str, str] = field(init=False)  # node -> why
    lighthouse_job: str = ""
    lighthouse_node: str = ""

    def __post_init__(self) -> None:
        self.folder = run_root(self.args.overrides) / self.args.name / "replica_ft"
        self.groups = {i: Group(i) for i in range(self.args.replicas)}
        self.excluded = {n: "--exclude" for n in self.args.exclude}

    def record(self, **event) -> None:
        with open(self.folder / "supervisor.jsonl", "a") as f:
            f.write(json.dumps({**event, "time": time.time()}) + "\n")

    def say(self, line: str) -> None:
        print(f"lmforge: {line}", flush=True)

    # ---- the Lighthouse ---------------------------------------------------------------------------------------
    def start_lighthouse(self) -> None:
        cmd = lighthouse_sbatch(self.args, self.folder)
        self.lighthouse_job = slurm_queue.sbatch(cmd)
        self.record(event="submit", role="lighthouse", job=self.lighthouse_job, exclude=self.args.exclude, cmd=cmd)
        deadline = time.monotonic() + self.args.lighthouse_wait_s
        while time.monotonic() < deadline:
            state = slurm_queue.job_states([self.lighthouse_job]).get(self.lighthouse_job)
            if state and state.ended:
                raise SystemExit(self.stop(f"the Lighthouse's job {self.lighthouse_job} ended {state.state}", 1))
            if state and state.state == "RUNNING" and state.nodes:
                self.lighthouse_node = state.nodes[0]
                self.record(event="start", role="lighthouse", job=self.lighthouse_job, nodes=state.nodes)
                self.say(f"Lighthouse job {self.lighthouse_job} on {self.lighthouse_node}:{self.args.port}")
                return
            time.sleep(self.args.poll_s)
        raise SystemExit(self.stop(f"the Lighthouse's job did not start in {self.args.lighthouse_wait_s:.0f} s", 1))

    # ---- the groups -------------------------------------------------------------------------------------------
    def submit(self, g: Group) -> None:
        exclude = sorted({self.lighthouse_node, *self.excluded})
        cmd = group_sbatch(self.args, self.folder, g.replica, self.lighthouse_node, exclude)
        g.job, g.started = slurm_queue.sbatch(cmd), False
        self.record(event="submit", role="group", replica=g.replica, attempt=g.attempt, job=g.job, exclude=exclude)
        self.say(f"replica group {g.replica}: job {g.job} (attempt {g.attempt}, excluding {','.join(exclude)})")

    def at_fault(self, end: slurm_queue.JobState, run_dir: Path) -> Dict[str, str]:
        """node -> why, the nodes of an ended job the group's next job must not use."""
        return nodes_at_fault(end, slurm_queue.unhealthy_nodes(end.nodes), run_dir)

    def ended(self, g: Group, end: slurm_queue.JobState) -> None:
        self.record(
            event="end", role="group", replica=g.replica, job=g.job, state=end.state, rc=end.exit_code, nodes=end.nodes
        )
        run_dir = run_root(self.args.overrides) / self.args.name / f"replica-{g.replica}"
        if end.state == "COMPLETED" and finished(run_dir, g.job):
            g.final_rc = 0
            self.say(f"replica group {g.replica}: job {g.job} finished on {','.join(end.nodes)}")
            return
        why_not = self.why_not_resubmitted(g, end)
        if why_not:
            g.final_rc = end.exit_code if end.exit_code > 0 else 1
            self.record(event="give_up", replica=g.replica, job=g.job, reason=why_not)
            self.say(f"replica group {g.replica}: job {g.job} ended {end.state} (exit {end.exit_code}); {why_not}")
            return
        for node, why in self.at_fault(end, run_dir).items():
            if node not in self.excluded:
                self.excluded[node] = why
                self.record(event="exclude", replica=g.replica, job=g.job, node=node, reason=why)
        self.say(f"replica group {g.replica}: job {g.job} ended {end.state} on {','.join(end.nodes)}; resubmitting")
        g.attempt += 1
        self.submit(g)

    def why_not_resubmitted(self, g: Group, end: slurm_queue.JobState) -> str:
        if end.exit_code == CONFIG_ERROR and end.state != "NODE_FAIL":
            return "exit 2 is a config error (the job's .err log names it): not resubmitted"
        if end.state == NOT_RESUBMITTED:
            return "cancelled: not resubmitted"
        if g.attempt >= self.args.max_resubmits:
            return f"--max-resubmits {self.args.max_resubmits} spent"
        return ""

    def poll(self) -> bool:
        """One read of every job; False once no group is left to wait for."""
        live = {g.job: g for g in self.groups.values() if g.final_rc is None}
        states = slurm_queue.job_states([*live, self.lighthouse_job])
        lighthouse = states.get(self.lighthouse_job)
        if lighthouse and lighthouse.ended:
            raise SystemExit(self.stop(f"the Lighthouse's job {self.lighthouse_job} ended {lighthouse.state}", 1))
        for job, g in live.items():
            state = states.get(job)
            if state is None:
                continue
            if state.ended:
                self.ended(g, state)
            elif state.state == "RUNNING" and not g.started:
                g.started = True
                self.record(event="start", role="group", replica=g.replica, job=job, nodes=state.nodes)
        lost = self.quorum_lost()
        if lost:
            raise SystemExit(self.stop(lost, next(g.final_rc for g in self.groups.values() if g.final_rc)))
        return any(g.final_rc is None for g in self.groups.values())

    def quorum_lost(self) -> str:
        """Why the groups still running can never commit a step again ('' while they can): groups were given up and
        fewer than --min-replicas are left (they would wait for a quorum until they time out, then be resubmitted)."""
        given_up = [g.replica for g in self.groups.values() if g.final_rc]
        left = sum(1 for g in self.groups.values() if g.final_rc is None)
        if given_up and 0 < left < self.args.min_replicas:
            return (
                f"replica group(s) {','.join(map(str, given_up))} given up: the {left} left cannot reach "
                f"--min-replicas {self.args.min_replicas}"
            )
        return ""

    def stop(self, why: str, rc: int) -> int:
        """Cancel every job still there, record the exit, write the job's goodput.json, return ``rc``."""
        jobs = [g.job for g in self.groups.values() if g.job and g.final_rc is None]
        slurm_queue.scancel([*jobs, self.lighthouse_job] if self.lighthouse_job else jobs)
        self.record(event="exit", rc=rc, reason=why, cancelled=jobs)
        self.say(f"supervisor exits {rc}: {why}")
        announce_job_goodput(self.folder.parent)  # <name>/goodput.json over the groups, and its one line
        return rc

    def run(self) -> int:
        self.folder.mkdir(parents=True, exist_ok=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _: sys.exit(self.stop(signal.Signals(signum).name, 128 + signum)))
        try:
            self.start_lighthouse()
            for g in self.groups.values():
                self.submit(g)
            while self.poll():
                time.sleep(self.args.poll_s)
        except slurm_queue.SlurmError as e:  # e.g. every node left is excluded: sbatch refuses the job
            return self.stop(str(e), 1)
        failed = [g.final_rc for g in self.groups.values() if g.final_rc]
        return self.stop("every group finished" if not failed else "a group was given up", failed[0] if failed else 0)


def check_nodes(args: argparse.Namespace) -> None:
    """Enough usable nodes for every group plus the Lighthouse's own node, else one line and exit 2."""
    try:
        usable = [n for n in slurm_queue.usable_nodes() if n not in args.exclude]
    except slurm_queue.SlurmError as e:
        print(f"torchft_supervisor.sh: {e}. Fix: run it where sbatch and sinfo reach the cluster", file=sys.stderr)
        sys.exit(CONFIG_ERROR)
    need = args.replicas * args.nodes_per_group + 1
    if len(usable) < need:
        print(
            f"torchft_supervisor.sh: --replicas {args.replicas} x --nodes-per-group {args.nodes_per_group} plus the "
            f"Lighthouse's node need {need} nodes; Slurm has {len(usable)} usable ({','.join(usable) or 'none'}). "
            "Fix: fewer replica groups, or free nodes",
            file=sys.stderr,
        )
        sys.exit(CONFIG_ERROR)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    folder = run_root(args.overrides) / args.name / "replica_ft"
    if args.dry_run:
        host = args.lighthouse_node or "<the Lighthouse's node>"
        print("sbatch " + " ".join(lighthouse_sbatch(args, folder)))
        for i in range(args.replicas):
            print("sbatch " + " ".join(group_sbatch(args, folder, i, host, sorted({host, *args.exclude}))))
        return 0
    check_nodes(args)
    return Supervisor(args).run()


if __name__ == "__main__":
    sys.exit(main())
