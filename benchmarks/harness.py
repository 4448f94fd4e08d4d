"""Run named benchmark cases side by side and print medians and ratios against a baseline case.

A case is a callable doing one unit of work (e.g. one training step). Cases are interleaved round-robin
(case A, case B, A, B, ...) after warm-up, so slow drift of a noisy machine hits every case alike; each
reports the median of its repeats. Results are printed as a table and written as JSON under
``benchmarks/results/scratch/<suite>.json`` (``benchmarks/paths.py``).
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch

from benchmarks.paths import scratch_path


@dataclass
class Case:
    name: str
    fn: Callable[[], None]
    units: float = 1.0  # work per call (e.g. tokens), for a per-second rate
    unit_name: str = "items"
    setup: Optional[Callable[[], None]] = None
    extra: Dict[str, float] = field(default_factory=dict)


@dataclass
class Result:
    name: str
    median_s: float
    times_s: List[float]
    rate: float
    unit_name: str
    extra: Dict[str, float]


def run_suite(
    suite: str,
    cases: List[Case],
    repeats: int = 7,
    warmup: int = 2,
    baseline: Optional[str] = None,
    sync: Optional[Callable[[], None]] = None,
    progress: bool = False,
) -> List[Result]:
    """``progress``: print each repeat round's times as it finishes (flushed), for long cases."""
    sync = sync or (lambda: None)
    for case in cases:
        if case.setup:
            case.setup()
        for _ in range(warmup):
            case.fn()
        sync()
    times: Dict[str, List[float]] = {c.name: [] for c in cases}
    for _ in range(repeats):
        for case in cases:
            sync()
            t0 = time.perf_counter()
            case.fn()
            sync()
            times[case.name].append(time.perf_counter() - t0)
        if progress:
            print(
                f"  round {len(times[cases[0].name])}/{repeats}: "
                + ", ".join(f"{c.name} {times[c.name][-1]:.3f} s" for c in cases),
                flush=True,
            )
    results = []
    for case in cases:
        med = statistics.median(times[case.name])
        results.append(Result(case.name, med, times[case.name], case.units / med, case.unit_name, case.extra))
    report(suite, results, baseline or cases[0].name)
    return results


def report(suite: str, results: List[Result], baseline: str) -> None:
    base = next(r for r in results if r.name == baseline)
    print(f"\n== {suite} (median of {len(base.times_s)} interleaved repeats; ratio = rate / rate of '{baseline}') ==")
    extra_keys = sorted({k for r in results for k in r.extra})
    header = f"{'case':<34} {'median s':>10} {'rate':>14} {'ratio':>7}" + "".join(f" {k:>12}" for k in extra_keys)
    print(header)
    print("-" * len(header))
    for r in results:
        line = f"{r.name:<34} {r.median_s:>10.4f} {r.rate:>10,.0f} {r.unit_name[:3]:>3} {r.rate / base.rate:>7.3f}"
        line += "".join(f" {r.extra.get(k, float('nan')):>12.4g}" for k in extra_keys)
        print(line)
    payload = {
        "suite": suite,
        "baseline": baseline,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "results": [
            {
                "name": r.name,
                "median_s": r.median_s,
                "times_s": r.times_s,
                "rate": r.rate,
                "unit": r.unit_name,
                "ratio": r.rate / base.rate,
                **r.extra,
            }
            for r in results
        ],
    }
    scratch_path(f"{suite}.json").write_text(json.dumps(payload, indent=1))


def add_host_malloc_flag(ap) -> None:
    """``--host-malloc``: the allocator mode of a CPU training run (``train.host_malloc``; ``auto`` resolves to
    ``retain`` on the CPU), so a suite measures what the trainer does; ``system`` (glibc as it is) for a before/after
    in a second invocation (the switches are process-wide)."""
    ap.add_argument(
        "--host-malloc",
        choices=["retain", "system"],
        default="retain",
        help="train.host_malloc for this process (default retain, as a CPU run)",
    )


def one_process_engine(model: str, batch: int, device_name: str, seq_len: int = 0):
    """A one-process (gloo, a group of one) native engine of ``model`` at ``batch`` sequences per step, and the
    micro batch of random tokens its steps take: ``(cfg, device, engine, micro_batch)``."""
    from lmforge.comm.process_group import init_process_group
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.parallel.native_engine import NativeEngine

    overrides = [
        f"model={model}",
        f"train.micro_batch_size={batch}",
        f"train.global_batch_size={batch}",
        f"train.device={device_name}",
    ]
    if seq_len:
        overrides.append(f"model.seq_len={seq_len}")
    cfg = validate(compose(overrides), world_size=1)
    device = torch.device(device_name)
    init_process_group(cfg.comm, device)
    engine = NativeEngine(cfg, device)
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len), device=device)

    class MicroBatch:  # lmforge.data.loader.MicroBatch's fields the engine reads
        tokens = x
        targets = x
        positions = None  # no document masking

    return cfg, device, engine, MicroBatch
