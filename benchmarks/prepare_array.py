"""Sharded preparation as a Slurm array on the suite's test cluster: 1 task vs 2 tasks, same inputs.

    sudo python -m benchmarks.prepare_array [--mb 12] [--files 8] [--tasks 1 2]

Starts the 4-node test cluster (tests/slurm/cluster.py; needs root and slurm-wlm), writes ``--files`` JSONL
files of real text (Austen + Python stdlib source), and for each task count T submits
``lmforge data prepare ... --shard-size 1 --launcher slurm-array --array-tasks T --sbatch-arg=--exclusive``
(one task per node, one tokenizer process each). Array time = from submission to the last shard's sidecar;
finalize = from then to manifest.json. Speed-up = array time at 1 task / array time at T tasks; the outputs of
every T are checked byte-identical. The test cluster's nodes share this machine's cores, so T tasks can go at
most min(T, free cores) times faster. JSON goes to benchmarks/results/prepare_array.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=12.0)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--tasks", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests" / "slurm"))
    from cluster import SlurmCluster, unavailable_reason

    from benchmarks.data_prepare import corpus

    reason = unavailable_reason()
    if reason:
        print(f"prepare_array: {reason}", file=sys.stderr)
        return 2
    cache = Path(os.environ.get("LMFORGE_DATA_CACHE", ".cache/lmforge-data")).absolute()
    env = {"LMFORGE_REPO": str(REPO), "LMFORGE_PYTHON": sys.executable, "LMFORGE_DATA_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), os.environ.get("PYTHONPATH", "")])}
    rows, outputs = [], {}
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-array-") as tmp:
        root = Path(tmp)
        docs = corpus(args.mb)
        (root / "in").mkdir()
        for i in range(args.files):
            (root / "in" / f"p{i:03d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                                 for t in docs[i::args.files]))
        mb = sum(len(d.encode()) for d in docs) / 1e6
        (root / "slurm").mkdir()
        cluster = SlurmCluster.start(root / "slurm", nodes=4)
        try:
            for tasks in args.tasks:
                out = root / f"out-{tasks}"
                t0 = time.time()
                cluster.client([sys.executable, "-m", "lmforge.data.prepare", str(root / "in"), "--out", str(out),
                                "--shard-size", "1", "--workers", "1", "--cache-dir", str(cache),
                                "--launcher", "slurm-array", "--array-tasks", str(tasks),
                                "--sbatch-arg=--exclusive"], cwd=root, env=env, timeout=120)
                while not (out / "manifest.json").exists():
                    if time.time() - t0 > 900:
                        raise RuntimeError(f"no manifest after 900 s: {sorted(p.name for p in out.iterdir())}")
                    time.sleep(0.2)
                shards_done = max(p.stat().st_mtime for p in out.glob("shard-*.meta.json"))
                row = {"tasks": tasks, "text_mb": round(mb, 2), "array_s": round(shards_done - t0, 2),
                       "finalize_s": round((out / "manifest.json").stat().st_mtime - shards_done, 2)}
                rows.append(row)
                outputs[tasks] = {p.name: p.read_bytes() for p in sorted(out.iterdir())
                                  if p.suffix in (".bin", ".idx") or p.name == "manifest.json"}
                print(f"tasks={tasks}  array {row['array_s']:.1f} s ({mb / row['array_s']:.2f} MB/s)  "
                      f"finalize {row['finalize_s']:.1f} s", flush=True)
        finally:
            cluster.stop()
    base = rows[0]["array_s"]
    for row in rows:
        row["speedup"] = round(base / row["array_s"], 2)
    same = all(o == outputs[args.tasks[0]] for o in outputs.values())
    print(f"speed-up vs {args.tasks[0]} task(s): {[r['speedup'] for r in rows]}; outputs byte-identical: {same}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prepare_array.json").write_text(json.dumps({"args": vars(args), "rows": rows,
                                                            "byte_identical": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
