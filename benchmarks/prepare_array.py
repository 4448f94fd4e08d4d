"""Sharded preparation as a Slurm array on the suite's test cluster: 1 task vs 2 tasks, same inputs.

    sudo python -m benchmarks.prepare_array [--mb 12] [--files 8] [--tasks 1 2]

Starts the 4-node test cluster (tests/slurm/cluster.py; needs root and slurm-wlm), writes ``--files`` JSONL
files of real text (Austen + Python stdlib source), and for each task count T submits
``lmforge data prepare ... --shard-size 1 --launcher slurm-array --array-tasks T --sbatch-arg=--exclusive``
(one task per node, one tokenizer process each). Array time = from submission to the last shard's sidecar;
finalize = from then to manifest.json. Speed-up = array time at 1 task / array time at T tasks; the outputs of
every T are checked byte-identical.

Each task's Python runs under a small wrapper (``LMFORGE_PYTHON``) that records its wall time and its CPU time
(user + sys of the process and its children, ``getrusage``), and the manifest gives the tokens of the shards
each task built. So the report shows how the work splits (tokens and CPU seconds per task, against the
1-task run) separately from the wall time, which on the test cluster is bounded by the cores its nodes share
(this machine's): T tasks can go at most min(T, free cores) times faster. ``--shard-size`` is passed through
(default 1 file per shard). JSON goes to benchmarks/results/scratch/prepare_array.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.paths import scratch_path

REPO = Path(__file__).resolve().parents[1]


WRAPPER = """#!{python}
# LMFORGE_PYTHON for one array task: runs the real Python, then records wall and CPU time (getrusage).
import json, os, resource, subprocess, sys, time
t0 = time.time()
rc = subprocess.call([{python!r}, *sys.argv[1:]])
t1 = time.time()
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
name = os.environ.get("SLURM_ARRAY_JOB_ID", os.environ.get("SLURM_JOB_ID", "0")) + "_" + \\
    os.environ.get("SLURM_ARRAY_TASK_ID", "final")
with open(os.path.join({timing!r}, name + ".json"), "w") as fh:
    json.dump({{"task": os.environ.get("SLURM_ARRAY_TASK_ID"), "job": os.environ.get("SLURM_ARRAY_JOB_ID"),
               "start": t0, "end": t1, "wall_s": t1 - t0, "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
               "finalize": "--finalize" in sys.argv, "rc": rc}}, fh)
sys.exit(rc)
"""


def task_figures(out: Path, timing: Path, job: str, tasks: int) -> list:
    """Per array task: tokens and documents of the groups it built (i % tasks), wall and CPU seconds."""
    plan = json.loads((out / "plan.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    group_of = {g["name"]: i for i, g in enumerate(plan["shards"])}
    figures = []
    total = manifest["tokens"]
    for t in range(tasks):
        rec = json.loads((timing / f"{job}_{t}.json").read_text())
        shards = [s for s in manifest["shards"] if group_of[s["name"][: len("shard-00000")]] % tasks == t]
        tokens = sum(s["tokens"] for s in shards)
        figures.append(
            {
                "task": t,
                "tokens": tokens,
                "token_share": round(tokens / total, 4),
                "documents": sum(s["documents"] for s in shards),
                "wall_s": round(rec["wall_s"], 2),
                "user_s": round(rec["user_s"], 2),
                "sys_s": round(rec["sys_s"], 2),
                "cpu_s": round(rec["user_s"] + rec["sys_s"], 2),
            }
        )
    return figures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=12.0)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--tasks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shard-size", default="1")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests" / "slurm"))
    from cluster import SlurmCluster, unavailable_reason

    from benchmarks.data_prepare import corpus

    reason = unavailable_reason()
    if reason:
        print(f"prepare_array: {reason}", file=sys.stderr)
        return 2
    cache = Path(os.environ.get("LMFORGE_DATA_CACHE", ".cache/lmforge-data")).absolute()
    rows, outputs = [], {}
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-array-") as tmp:
        root = Path(tmp)
        (root / "timing").mkdir()
        wrapper = root / "timed-python"
        wrapper.write_text(WRAPPER.format(python=sys.executable, timing=str(root / "timing")))
        wrapper.chmod(0o755)
        # one core per task: --workers 1 tokenizes in the task's process, where the tokenizers library would
        # otherwise use a thread per core for encode_batch
        env = {
            "LMFORGE_REPO": str(REPO),
            "LMFORGE_PYTHON": str(wrapper),
            "LMFORGE_DATA_CACHE": str(cache),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), os.environ.get("PYTHONPATH", "")]),
        }
        docs = corpus(args.mb)
        (root / "in").mkdir()
        for i in range(args.files):
            (root / "in" / f"p{i:03d}.jsonl").write_text(
                "".join(json.dumps({"text": t}) + "\n" for t in docs[i :: args.files])
            )
        mb = sum(len(d.encode()) for d in docs) / 1e6
        (root / "slurm").mkdir()
        cluster = SlurmCluster.start(root / "slurm", nodes=4)
        try:
            for tasks in args.tasks:
                out = root / f"out-{tasks}"
                t0 = time.time()
                submit = [
                    sys.executable,
                    "-m",
                    "lmforge.data.prepare",
                    str(root / "in"),
                    "--out",
                    str(out),
                    "--shard-size",
                    args.shard_size,
                    "--workers",
                    "1",
                    "--cache-dir",
                    str(cache),
                    "--launcher",
                    "slurm-array",
                    "--array-tasks",
                    str(tasks),
                    "--sbatch-arg=--exclusive",
                ]
                proc = cluster.client(submit, cwd=root, env=env, timeout=120)
                job = re.search(r"array job (\d+)", proc.stdout).group(1)
                while not (out / "manifest.json").exists():
                    if time.time() - t0 > 900:
                        raise RuntimeError(f"no manifest after 900 s: {sorted(p.name for p in out.iterdir())}")
                    time.sleep(0.2)
                shards_done = max(p.stat().st_mtime for p in out.glob("shard-*.meta.json"))
                row = {
                    "tasks": tasks,
                    "text_mb": round(mb, 2),
                    "array_s": round(shards_done - t0, 2),
                    "finalize_s": round((out / "manifest.json").stat().st_mtime - shards_done, 2),
                    "per_task": task_figures(out, root / "timing", job, tasks),
                }
                final_job = re.search(r"job (\d+) checks", proc.stdout).group(1)
                final_path = root / "timing" / f"{final_job}_final.json"
                while not final_path.exists() and time.time() - t0 < 900:  # written as the finalize job exits
                    time.sleep(0.2)
                final = json.loads(final_path.read_text())
                # the finalize job: Python, imports, reading the plan and indexes: about a task's fixed cost
                row["finalize_job"] = {
                    "wall_s": round(final["wall_s"], 2),
                    "cpu_s": round(final["user_s"] + final["sys_s"], 2),
                }
                row["task_wall_sum_s"] = round(sum(t["wall_s"] for t in row["per_task"]), 2)
                row["task_cpu_sum_s"] = round(sum(t["cpu_s"] for t in row["per_task"]), 2)
                rows.append(row)
                for t in row["per_task"]:
                    print(
                        f"  task {t['task']}: {t['tokens']} tokens ({t['token_share']:.3f}), "
                        f"wall {t['wall_s']:.1f} s, cpu {t['cpu_s']:.1f} s (user {t['user_s']:.1f} + "
                        f"sys {t['sys_s']:.1f})",
                        flush=True,
                    )
                outputs[tasks] = {
                    p.name: p.read_bytes()
                    for p in sorted(out.iterdir())
                    if p.suffix in (".bin", ".idx") or p.name == "manifest.json"
                }
                print(
                    f"tasks={tasks}  array {row['array_s']:.1f} s ({mb / row['array_s']:.2f} MB/s)  "
                    f"finalize {row['finalize_s']:.1f} s  sum of task walls {row['task_wall_sum_s']:.1f} s, "
                    f"of task CPU {row['task_cpu_sum_s']:.1f} s; finalize job wall {final['wall_s']:.1f} s, "
                    f"CPU {row['finalize_job']['cpu_s']:.1f} s",
                    flush=True,
                )
        finally:
            cluster.stop()
    base, cpu_base = rows[0]["array_s"], rows[0]["task_cpu_sum_s"]
    for row in rows:
        row["speedup"] = round(base / row["array_s"], 2)
        # each task's CPU time as a fraction of the first run's total: 1/T for a perfectly even split
        row["task_cpu_fraction"] = [round(t["cpu_s"] / cpu_base, 3) for t in row["per_task"]]
    same = all(o == outputs[args.tasks[0]] for o in outputs.values())
    print(f"speed-up vs {args.tasks[0]} task(s): {[r['speedup'] for r in rows]}; outputs byte-identical: {same}")
    scratch_path("prepare_array.json").write_text(
        json.dumps({"args": vars(args), "rows": rows, "byte_identical": same}, indent=1)
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
