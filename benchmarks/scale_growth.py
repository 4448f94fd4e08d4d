"""How lmforge's costs grow with the world: the quantities that do not depend on the core count, at world 1, 2, 4,
8, 16, 32 (``model=tiny``, gloo, FSDP over the whole world: ``parallelism.dp_shard=W``, 2 samples a rank), each
checked against its algorithmic model.

    python -m benchmarks.scale_growth [--worlds 1 2 4 8 16 32] [--steps 3]

Each world is one real launch (``torchrun --standalone``, ``benchmarks.scale_rank`` around ``lmforge.train``):
3 steps, the final checkpoint saved synchronously, W&B off. Measured per world:

- checkpoint files and bytes; DCP ``.metadata`` bytes, its state-dict entries and storage chunks;
- rendezvous store operations of the workers (each worker's ``env://`` store wrapped in a counting store:
  gloo's connection set-up of every process group, store barriers, lmforge's keys), per rank and in total;
- pickled bytes of object collectives received by rank 0 at start-up and at save;
- c10d operations in one training step (rank 0, the second step, under ``torch.profiler``);
- rank 0's peak resident memory; CPU-seconds per rank (import, start-up to the first step, the whole run);
  the 1-minute load average before and after each launch (on a shared machine CPU-seconds include
  scheduling overhead; wall time is not reported, it measures time-slicing).

Then each quantity's model (``MODELS``: q(W) = q(2) + c * (g(W) - g(2)), only c fitted by least squares, anchored
at W = 2, the smallest world that communicates; ``DERIVED``: composed of fitted models) is checked against the points (the largest relative deviation) and extrapolated to 1,024 and 16,384 ranks.
JSON: benchmarks/results/scratch/scale_growth.json (``--merge FILE`` adds earlier worlds' points, so the big
worlds can run on their own).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

from benchmarks.paths import scratch_path
from lmforge.runtime.hardware import cpu_model

REPO = Path(__file__).resolve().parents[1]
EXTRAPOLATE = (1024, 16384)
BASE = [
    "model=tiny",
    "comm=cpu_gloo",
    "train.device=cpu",
    "train.precision=fp32",
    "train.threads=1",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "checkpoint.every_steps=0",
    "logging.wandb.mode=disabled",
    "logging.console=plain",
]


def overrides(world: int, steps: int, root: Path) -> List[str]:
    layout = ["parallelism=fsdp", f"parallelism.dp_shard={world}"]  # W = 1 too: the same state dict at every W
    return (
        BASE
        + layout
        + [f"train.max_steps={steps}", f"train.global_batch_size={2 * world}"]
        + [
            f"run.root={root}",
            f"run.name=w{world}",
        ]
    )


def checkpoint_facts(step_dir: Path) -> Dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    files = [p for p in step_dir.iterdir() if p.is_file()]
    meta = FileSystemReader(str(step_dir)).read_metadata()
    chunks = sum(
        len(m.chunks) if isinstance(m, TensorStorageMetadata) else 1 for m in meta.state_dict_metadata.values()
    )
    return {
        "checkpoint_files": len(files),
        "checkpoint_bytes": sum(p.stat().st_size for p in files),
        "shard_files": len([p for p in files if p.suffix == ".distcp"]),
        "metadata_bytes": (step_dir / ".metadata").stat().st_size,
        "metadata_entries": len(meta.state_dict_metadata),
        "metadata_chunks": chunks,
        "metadata_storage_items": len(meta.storage_data or {}),
    }


def launch(world: int, steps: int, tmp: Path) -> Tuple[List[Dict], Dict]:
    out = tmp / "ranks"
    out.mkdir(parents=True)
    env = {
        **os.environ,
        "LMFORGE_SCALE_OUT": str(out),
        "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), str(REPO)]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += ["-m", "benchmarks.scale_rank", *overrides(world, steps, tmp / "runs")]
    load0 = os.getloadavg()
    with open(tmp / "launch.log", "w") as log:
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=3000)
    if proc.returncode != 0:
        raise RuntimeError(
            f"world {world}: launch failed ({proc.returncode}); log:\n{(tmp / 'launch.log').read_text()[-3000:]}"
        )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    step_dir = next((tmp / "runs" / f"w{world}" / "checkpoints").glob("step-*"))
    return ranks, {**checkpoint_facts(step_dir), "load_average": [round(load0[0], 2), round(os.getloadavg()[0], 2)]}


def summarize(world: int, ranks: List[Dict], ckpt: Dict) -> Dict:
    zero = ranks[0]
    store = [sum(r["store_ops"].values()) for r in ranks]
    cpu = lambda key, start: [r["cpu_s"][key] - r["cpu_s"][start] for r in ranks]  # noqa: E731
    ops = {k: v for k, v in zero["step_collectives"].items() if "_wrap_tensor" not in k}
    return {
        "world": world,
        **ckpt,
        "store_ops_rank0": store[0],
        "store_ops_per_rank_max": max(store),
        "store_ops_total": sum(store),
        "store_ops_rank0_by_kind": zero["store_ops"],
        "gathered_bytes_rank0_startup": zero["object_bytes_received"].get("startup", 0),
        "gathered_bytes_rank0_save": zero["object_bytes_received"].get("save", 0),
        "object_collectives_rank0": zero["object_collectives"],
        "peak_rss_mib_rank0": round(zero["peak_rss_mib"], 1),
        "peak_rss_mib_max": round(max(r["peak_rss_mib"] for r in ranks), 1),
        "collectives_per_step_rank0": sum(ops.values()),
        "collectives_per_step_by_op": ops,
        "cpu_s_import_per_rank": round(statistics.mean(cpu("imported", "python_start")), 2),
        "cpu_s_startup_per_rank": round(statistics.mean(cpu("first_step", "imported")), 2),
        "cpu_s_total_per_rank": round(statistics.mean(cpu("end", "python_start")), 2),
        "cpu_s_total_per_rank_max": round(max(cpu("end", "python_start")), 2),
    }


ANCHOR = 2  # the smallest world that communicates (at W = 1 there is no gloo mesh, no gather, no collective)

# quantity -> (g(W), the model in words). q(W) = q(ANCHOR) + c * (g(W) - g(ANCHOR)); only c is fitted.
MODELS: Dict[str, Tuple[Callable[[float], float], str]] = {
    "checkpoint_files": (lambda w: w, "one .distcp per rank + 3 (.metadata, state.json, COMPLETE): O(W)"),
    "checkpoint_bytes": (lambda w: w, "the sharded state S (constant) + per-rank file and chunk headers: O(S + T x W)"),
    "metadata_bytes": (lambda w: w, "one chunk record per sharded tensor per rank: O(T x W)"),
    "metadata_chunks": (lambda w: w, "sharded tensors x W + unsharded entries: O(T x W)"),
    "metadata_entries": (lambda w: w, "one entry per state-dict key, a few of them per rank (RNG, loader): O(T + W)"),
    "store_ops_per_rank_max": (lambda w: w, "gloo full mesh: each rank publishes its address, reads W-1: O(W)"),
    "gathered_bytes_rank0_startup": (lambda w: w, "all_gather_object of a fixed-size record per rank: O(W)"),
    "gathered_bytes_rank0_save": (
        lambda w: w,
        "DCP: every rank's local plan (an item per tensor shard) on rank 0: O(T x W)",
    ),
    "collectives_per_step_rank0": (lambda w: 0.0, "FSDP: all-gathers + reduce-scatters per block: O(layers), not W"),
    "cpu_s_startup_per_rank": (lambda w: w, "constant + gloo connections to W-1 peers: O(W) per rank"),
}
NOISY = {"cpu_s_startup_per_rank"}  # a slope below the noise of a shared machine: c < 0 is reported as 0 (unresolved)
DERIVED = {  # quantity -> (from the fitted models, words): no constant of its own
    "store_ops_total": (
        lambda w, per_rank: w * per_rank(w),
        "W ranks x the per-rank model: O(W^2) requests on the one store server",
    ),
    "peak_rss_mib_rank0": (
        lambda w, fits: (
            fits["peak_rss_mib_rank0@2"]
            + (fits["gathered_bytes_rank0_save"](w) + fits["metadata_bytes"](w) - fits["bytes@2"]) / 2**20
        ),
        "runtime + state shard + what rank 0 holds at save, the gathered plans and the metadata (their pickled "
        "bytes, a lower bound): O(T x W)",
    ),
}


def fitted(points: List[Dict], key: str) -> Tuple[Callable[[float], float], float, float]:
    g, _ = MODELS[key]
    anchor = next(p for p in points if p["world"] == ANCHOR)[key]
    xs = [(g(p["world"]) - g(ANCHOR), p[key] - anchor) for p in points if p["world"] > ANCHOR]
    den = sum(x * x for x, _ in xs)
    c = sum(x * y for x, y in xs) / den if den else 0.0
    if key in NOISY:
        c = max(c, 0.0)
    return (lambda w: anchor + c * (g(w) - g(ANCHOR))), anchor, c


def check(points: List[Dict], key: str, model: Callable[[float], float], words: str, **extra) -> Dict:
    dev = max(abs(model(p["world"]) - p[key]) / max(abs(p[key]), 1e-9) for p in points if p["world"] >= ANCHOR)
    return {
        "model": words,
        **extra,
        "max_rel_deviation": round(dev, 4),
        "predicted": {str(p["world"]): round(model(p["world"]), 3) for p in points if p["world"] >= ANCHOR},
        "extrapolated": {str(w): model(w) for w in EXTRAPOLATE},
    }


def fit_all(points: List[Dict]) -> Dict[str, Dict]:
    fits, models = {}, {}
    for key, (_, words) in MODELS.items():
        models[key], anchor, c = fitted(points, key)
        fits[key] = check(points, key, models[key], words, anchor=anchor, c=c)
    at2 = next(p for p in points if p["world"] == ANCHOR)
    models["peak_rss_mib_rank0@2"] = at2["peak_rss_mib_rank0"]
    models["bytes@2"] = at2["gathered_bytes_rank0_save"] + at2["metadata_bytes"]
    models["store_ops_total"] = models["store_ops_per_rank_max"]
    for key, (derive, words) in DERIVED.items():
        arg = models["store_ops_per_rank_max"] if key == "store_ops_total" else models
        fits[key] = check(points, key, lambda w, d=derive, a=arg: d(w, a), words)
    return fits


def print_table(points: List[Dict], fits: Dict[str, Dict]) -> None:
    worlds = [p["world"] for p in points]
    print("\n== scale_growth: FSDP over the world, model=tiny, gloo ==")
    head = (
        f"{'quantity':<30}"
        + "".join(f"{w:>10}" for w in worlds)
        + f"{'max dev':>9}"
        + "".join(f"{w:>12}" for w in EXTRAPOLATE)
    )
    print(head)
    print("-" * len(head))
    for key in list(MODELS) + list(DERIVED) + ["cpu_s_import_per_rank", "cpu_s_total_per_rank"]:
        row = f"{key:<30}" + "".join(f"{p[key]:>10.4g}" for p in points)
        if key in fits:
            f = fits[key]
            row += f"{f['max_rel_deviation']:>9.1%}" + "".join(
                f"{f['extrapolated'][str(w)]:>12.4g}" for w in EXTRAPOLATE
            )
        print(row)
    print("load average (before, after): " + ", ".join(f"W={p['world']}: {p['load_average']}" for p in points))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--merge", type=Path, help="an earlier scale_growth.json whose other worlds' points to keep")
    args = ap.parse_args(argv)
    cache = os.environ.setdefault("LMFORGE_DATA_CACHE", str(REPO / ".cache" / "lmforge-data"))
    points = {p["world"]: p for p in json.loads(args.merge.read_text())["points"]} if args.merge else {}
    for world in args.worlds:
        with tempfile.TemporaryDirectory(prefix=f"lmforge-scale-w{world}-") as tmp:
            ranks, ckpt = launch(world, args.steps, Path(tmp))
        points[world] = summarize(world, ranks, ckpt)
        print(
            f"world {world}: {json.dumps({k: v for k, v in points[world].items() if not isinstance(v, dict)})}",
            flush=True,
        )
    ordered = [points[w] for w in sorted(points)]
    fits = fit_all(ordered)
    print_table(ordered, fits)
    payload = {
        "suite": "scale_growth",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform()},
        "layout": "parallelism=fsdp parallelism.dp_shard=W, model=tiny, 2 samples a rank",
        "data_cache": cache,
        "points": ordered,
        "models": fits,
    }
    scratch_path("scale_growth.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
