"""Goodput under repeated failures: replica fault tolerance against whole-job restarts, the same replicas, one run.

    python -m benchmarks.replica_goodput [--steps 60] [--kill-every-s 15] [--kills 3] [--out FILE]

The same three replicas of ``model=tiny`` (CPU, gloo, steps of about 1 s with ``fault.drill.step_sleep_s=1``,
checkpoints every 8 steps), run twice, one after the other:

(a) replica FT: ``python -m lmforge.launch.replica_ft --replicas 3`` (launchers/torchft_local.sh), one group
    process each, restarted at once when it dies (it heals from a peer);
(b) whole-job restarts: one DDP job of 3 ranks under torchrun (launchers/torchrun_local.sh ``--nproc 3``), all
    ranks restarted from the newest checkpoint when one dies.

In both, ``--kills`` replicas are SIGKILLed, in turn 0, 1, 2, ..., each ``--kill-every-s`` seconds after the one
before (the first that long after the first step). A kill is made only while the target is in its training loop
(never in a restart) and past the step of the kill before (torchrun's agent stops a job whose crash repeats an
earlier attempt's step: the repeated-crash verdict), and none once the leading replica is within ``--quiet-steps``
of the end. Each job's
goodput is read from its own goodput.json: the torchft job's ``<name>/goodput.json`` (the groups summed, in
replica-seconds) and the DDP run's (rank 0's ledger; its replica-seconds are 3 x its seconds). The JSON result
holds each goodput, wall, the kills and the causes, and the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from benchmarks.paths import RESULTS, scratch_path

REPLICAS = 3
COMMON = [
    "model=tiny",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "train.threads=1",
    "train.device=cpu",
    "logging.every_steps=1",
    "logging.console=plain",
    "checkpoint.every_steps=8",
    "fault.drill.step_sleep_s=1.0",
]
ROOT = Path(__file__).resolve().parents[1]
GOOD = ("productive", "reduced_membership")  # the causes whose time counts in goodput


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ledger_lines(path: Path) -> List[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def launches(run: Path) -> List[Path]:
    return sorted((run / "goodput").glob("launch-*.jsonl"))


def in_loop_since(run: Path, kills: int) -> bool:
    """The run's launch after its ``kills`` kills has started its loop (a step line written)."""
    ledgers = launches(run)
    return len(ledgers) > kills and any("s" in x for x in ledger_lines(ledgers[-1]))


def last_step(run: Path) -> int:
    """The last step the run's newest launch committed (0 before its first)."""
    ledgers = launches(run)
    steps = [int(x["s"]) for x in ledger_lines(ledgers[-1]) if "s" in x and not x.get("u")] if ledgers else []
    return max(steps, default=0)


def ft_pid(job: Path, replica: int) -> Optional[int]:
    """The running process of a replica group (launcher.jsonl: its last start with no exit after it)."""
    pid = None
    for e in ledger_lines(job / "replica_ft" / "launcher.jsonl"):
        if e.get("replica") == replica:
            pid = e["pid"] if e["event"] == "start" else None
    return pid


def torchrun_worker(tag: str, rank: int) -> Optional[int]:
    """The pid of the torchrun worker of ``rank`` among the processes started with LMFORGE_BENCH_TAG=tag."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(
                kv.split("=", 1)
                for kv in (proc / "environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in kv
            )
        except OSError:
            continue
        if env.get("LMFORGE_BENCH_TAG") == tag and env.get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in env:
            return int(proc.name)
    return None


def drive(
    proc: subprocess.Popen,
    run_of: Callable[[int], Path],
    pid_of: Callable[[int], Optional[int]],
    args: argparse.Namespace,
) -> List[dict]:
    """Kill replica 0, 1, 2, ... in turn, ``args.kills`` times, each ``args.kill_every_s`` seconds after the one
    before (the first after the first step), while the target is in its loop and past the step of the kill before
    (torchrun's agent treats a crash at a step that crashed before as deterministic and stops), and not once the
    leading replica is within ``args.quiet_steps`` of the end; wait for the job. Returns the kills."""
    steps, every_s, quiet_steps, timeout_s = args.steps, args.kill_every_s, args.quiet_steps, args.timeout_s
    kills: List[dict] = []
    per_run: Dict[Path, int] = {}  # launches of a run directory ended by a kill
    deadline = time.time() + timeout_s
    due: Optional[float] = None
    while proc.poll() is None:
        if time.time() > deadline:
            proc.terminate()
            raise SystemExit(f"replica_goodput: the job ran past {timeout_s:.0f} s; stopped")
        lead = max(last_step(run_of(i)) for i in range(REPLICAS))
        target = len(kills) % REPLICAS
        run = run_of(target)
        if due is None and in_loop_since(run_of(0), per_run.get(run_of(0), 0)):
            due = time.time() + every_s  # the clock starts with the first step
        ready = due is not None and time.time() >= due and lead <= steps - quiet_steps and len(kills) < args.kills
        past = not kills or last_step(run) > kills[-1]["step"]
        if ready and past and in_loop_since(run, per_run.get(run, 0)):
            pid = pid_of(target)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                kills.append({"replica": target, "time": time.time(), "step": last_step(run), "leading_step": lead})
                per_run[run] = per_run.get(run, 0) + 1
                print(f"replica_goodput: SIGKILL replica {target} (pid {pid}) at step {lead}", flush=True)
                due = time.time() + every_s
        time.sleep(0.2)
    return kills


def run_replica_ft(root: Path, args: argparse.Namespace, env: Dict[str, str]) -> dict:
    cmd = [sys.executable, "-m", "lmforge.launch.replica_ft", "--replicas", str(REPLICAS)]
    cmd += ["--max-restarts", "20", "--restart-delay-s", "0", "--name", "ft", "--port", str(free_port())]
    cmd += ["--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "10000", "--"]
    cmd += [f"run.root={root}", *COMMON, f"train.max_steps={args.steps}", "train.global_batch_size=2"]
    cmd += ["fault.replica_timeout_s=3", "fault.replica_quorum_timeout_s=60"]
    job = root / "ft"
    t0 = time.time()
    with open(root / "ft.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        kills = drive(
            proc,
            lambda i: job / f"replica-{i}",
            lambda i: ft_pid(job, i),
            args,
        )
    report = json.loads((job / "goodput.json").read_text())
    return {
        "command": " ".join(cmd[1:]),
        "returncode": proc.returncode,
        "elapsed_s": time.time() - t0,
        "kills": kills,
        "goodput": report["goodput"],
        "wall_s": report["wall_s"],
        "replica_seconds": report["replica_seconds"],
        "causes_replica_s": report["seconds"],
        "groups": [
            {k: g[k] for k in ("goodput", "launches", "committed_steps", "redone_steps", "skipped_steps")}
            | {"reduced_membership_steps": g["reduced_membership_steps"]}
            for g in report["groups"]
        ],
    }


def run_whole_job(root: Path, args: argparse.Namespace, env: Dict[str, str]) -> dict:
    tag = f"ddp-{os.getpid()}"
    cmd = ["bash", "launchers/torchrun_local.sh", "--nproc", str(REPLICAS), "--max-restarts", "20"]
    cmd += ["--port", str(free_port()), "--"]
    cmd += [f"run.root={root}", "run.name=ddp", *COMMON, f"train.max_steps={args.steps}", "train.global_batch_size=6"]
    cmd += ["parallelism=ddp", f"parallelism.dp_replicate={REPLICAS}"]
    run = root / "ddp"
    t0 = time.time()
    with open(root / "ddp.log", "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**env, "LMFORGE_BENCH_TAG": tag}, stdout=log, stderr=subprocess.STDOUT
        )
        kills = drive(
            proc,
            lambda i: run,
            lambda i: torchrun_worker(tag, i),
            args,
        )
    report = json.loads((run / "goodput.json").read_text())
    return {
        "command": " ".join(cmd),
        "returncode": proc.returncode,
        "elapsed_s": time.time() - t0,
        "kills": kills,
        "goodput": report["goodput"],
        "wall_s": report["wall_s"],
        "replica_seconds": REPLICAS * report["wall_s"],
        "causes_replica_s": {c: REPLICAS * s for c, s in report["seconds"].items()},
        "launches": report["launches"],
        "committed_steps": report["committed_steps"],
        "redone_steps": report["redone_steps"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-every-s", type=float, default=15.0)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--quiet-steps", type=int, default=15, help="no kill once the leading replica is this close")
    ap.add_argument("--timeout-s", type=float, default=420.0, help="per job")
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu-epyc-avx512" / "replica-goodput.json")
    args = ap.parse_args(argv)
    root = scratch_path("replica-goodput")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    load_before = os.getloadavg()
    ft = run_replica_ft(root, args, env)
    ddp = run_whole_job(root, args, env)
    result = {
        "benchmark": "replica_goodput",
        "command": "python -m benchmarks.replica_goodput " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": args.steps,
        "kill_every_s": args.kill_every_s,
        "kills": args.kills,
        "replicas": REPLICAS,
        "cpus": os.cpu_count(),
        "load_avg_1_5_15_before": load_before,
        "load_avg_1_5_15_after": os.getloadavg(),
        "replica_ft": ft,
        "whole_job_restarts": ddp,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, r in (("replica FT", ft), ("whole-job restarts", ddp)):
        lost = sorted(((s, c) for c, s in r["causes_replica_s"].items() if c not in GOOD and s > 0.05), reverse=True)
        print(
            f"{name}: goodput {r['goodput']:.1%}, wall {r['wall_s']:.1f} s ({r['replica_seconds']:.0f} replica-s), "
            f"{len(r['kills'])} kills, exit {r['returncode']}; " + ", ".join(f"{c} {s:.1f}" for s, c in lost)
        )
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
