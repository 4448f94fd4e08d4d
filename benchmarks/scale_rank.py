"""One rank of benchmarks/scale_growth.py: the real trainer (``lmforge.train.main``) under counters that do not
depend on the core count, written to ``$LMFORGE_SCALE_OUT/rank<R>.json`` when the run ends.

    torchrun --standalone --nproc-per-node W -m benchmarks.scale_rank <lmforge overrides>

Counted per phase (``startup``: until the first training step; ``train``; ``save``: inside
``CheckpointManager.save``; ``end``: after the loop):
- rendezvous store operations of this worker (the ``env://`` store torchrun hands it, wrapped in a counting
  ``torch.distributed.Store``: gloo's connection set-up, barriers and every key lmforge reads or writes);
- object collectives (``all_gather_object``, ``gather_object``, ``broadcast_object_list``,
  ``scatter_object_list``) and the pickled bytes each delivers to this rank;
- the c10d operations of one training step (``PROFILED_STEP``, under ``torch.profiler``: ``c10d::*`` and
  ``_c10d_functional::*`` events, ``wait_tensor`` left out);
- CPU-seconds (user + system, this process and its children) at import, at the first step and at the end, and
  the peak resident set size.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import sys
import time
from collections import Counter
from pathlib import Path

PROFILED_STEP = 2  # the first step warms caches; the second is a steady one


def cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Tally:
    def __init__(self) -> None:
        self.phase = "startup"
        self.store: Counter = Counter()
        self.objects: Counter = Counter()
        self.object_bytes: Counter = Counter()
        self.step_ops: Counter = Counter()
        self.cpu = {"python_start": cpu_s()}
        self.steps = 0

    def note_store(self, op: str) -> None:
        self.store[f"{self.phase}:{op}"] += 1

    def note_objects(self, op: str, received: list) -> None:
        self.objects[f"{self.phase}:{op}"] += 1
        self.object_bytes[self.phase] += sum(len(pickle.dumps(o)) for o in received if o is not None)


TALLY = Tally()
KEEP: list = []  # every counting store made: alive as long as the process


def counting_store_class():
    import torch.distributed as dist

    class CountingStore(dist.Store):
        """Every operation on the wrapped store, counted in TALLY under the current phase."""

        def __init__(self, inner) -> None:
            super().__init__()
            self.inner = inner

        def set(self, key, value):
            TALLY.note_store("set")
            return self.inner.set(key, value)

        def get(self, key):
            TALLY.note_store("get")
            return self.inner.get(key)

        def add(self, key, amount):
            TALLY.note_store("add")
            return self.inner.add(key, amount)

        def compare_set(self, key, expected, desired):
            TALLY.note_store("compare_set")
            return self.inner.compare_set(key, expected, desired)

        def wait(self, keys, timeout=None):
            TALLY.note_store("wait")
            return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

        def check(self, keys):
            TALLY.note_store("check")
            return self.inner.check(keys)

        def delete_key(self, key):
            TALLY.note_store("delete_key")
            return self.inner.delete_key(key)

        def num_keys(self):
            TALLY.note_store("num_keys")
            return self.inner.num_keys()

        def append(self, key, value):
            TALLY.note_store("append")
            return self.inner.append(key, value)

        def multi_get(self, keys):
            TALLY.note_store("multi_get")
            return self.inner.multi_get(keys)

        def multi_set(self, keys, values):
            TALLY.note_store("multi_set")
            return self.inner.multi_set(keys, values)

        def list_keys(self):
            TALLY.note_store("list_keys")
            return self.inner.list_keys()

        def has_extended_api(self):
            return self.inner.has_extended_api()

        def clone(self):  # gloo's connection set-up works on a clone: its operations count too
            KEEP.append(CountingStore(self.inner.clone()))
            return KEEP[-1]

        def set_timeout(self, timeout):
            return self.inner.set_timeout(timeout)

    return CountingStore


def install_store_counter() -> None:
    import torch.distributed.distributed_c10d as c10d

    wrap, rendezvous = counting_store_class(), c10d.rendezvous

    def counted(*args, **kwargs):
        for store, rank, world in rendezvous(*args, **kwargs):
            KEEP.append(wrap(store))  # the Python object must outlive the C++ references to it (pybind trampoline)
            yield KEEP[-1], rank, world

    c10d.rendezvous = counted


OBJECT_COLLECTIVES = {  # name -> the argument that holds what this rank received
    "all_gather_object": "object_list",
    "gather_object": "object_gather_list",
    "broadcast_object_list": "object_list",
    "scatter_object_list": "scatter_object_output_list",
}


def install_object_counters() -> None:
    import inspect

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def counted(name: str, received: str):
        fn = getattr(c10d, name)
        signature = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            TALLY.note_objects(name, signature.bind(*args, **kwargs).arguments.get(received) or [])
            return out

        return wrapper

    for name, received in OBJECT_COLLECTIVES.items():
        wrapper = counted(name, received)
        setattr(dist, name, wrapper)
        setattr(c10d, name, wrapper)


def install_phase_marks() -> None:
    import torch

    from lmforge.checkpoint.manager import CheckpointManager
    from lmforge.parallel.native_engine import NativeEngine

    train_step, save = NativeEngine.train_step, CheckpointManager.save

    def counted_step(self, *args, **kwargs):
        TALLY.steps += 1
        if TALLY.steps == 1:
            TALLY.cpu["first_step"] = cpu_s()
        TALLY.phase = "train"
        if TALLY.steps != PROFILED_STEP:
            return train_step(self, *args, **kwargs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = train_step(self, *args, **kwargs)
        for e in prof.events():
            if (e.name.startswith(("c10d::", "_c10d_functional::"))) and "wait_tensor" not in e.name:
                TALLY.step_ops[e.name] += 1
        return out

    def counted_save(self, *args, **kwargs):
        before, TALLY.phase = TALLY.phase, "save"
        try:
            return save(self, *args, **kwargs)
        finally:
            TALLY.phase = before

    NativeEngine.train_step, CheckpointManager.save = counted_step, counted_save


def write(rank: int, rc: int) -> None:
    TALLY.cpu["end"] = cpu_s()
    out = Path(os.environ["LMFORGE_SCALE_OUT"]) / f"rank{rank}.json"
    record = {
        "rank": rank,
        "rc": rc,
        "steps": TALLY.steps,
        "cpu_s": TALLY.cpu,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "store_ops": dict(TALLY.store),
        "object_collectives": dict(TALLY.objects),
        "object_bytes_received": dict(TALLY.object_bytes),
        "step_collectives": dict(TALLY.step_ops),
        "wall_end": time.time(),
    }
    out.write_text(json.dumps(record, indent=1))


def main() -> int:
    rank = int(os.environ.get("RANK", "0"))
    install_store_counter()
    install_object_counters()
    import lmforge.train

    install_phase_marks()
    TALLY.cpu["imported"] = cpu_s()
    rc = 1
    try:
        rc = lmforge.train.main(sys.argv[1:]) or 0
    except SystemExit as e:
        rc = int(e.code or 0)
    finally:
        TALLY.phase = "end"
        write(rank, rc)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
