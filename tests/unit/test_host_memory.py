"""train.host_malloc (runtime/host_memory.py): with ``retain`` a process that frees and re-allocates large
tensors, as every CPU training step does with its logits and gradients, reuses the same pages once its heap has
grown to fit them (no page faults in the last rounds); with ``system`` (glibc as it is, the negative control) the
block over glibc's mmap threshold is faulted in anew every round. Each mode runs in a fresh process: the switches
are process-wide and cannot be undone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lmforge.runtime import host_memory

PROBE = r"""
import json, resource, sys
import torch
from lmforge.runtime import host_memory

in_force = host_memory.apply(sys.argv[1])
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    logits = torch.empty(12 << 20)  # 48 MiB: above glibc's largest mmap threshold (32 MiB)
    logits.fill_(1.0)  # the first touch of every page
    grad = torch.empty(6 << 20).fill_(2.0)  # a second, smaller block freed in the other order
    del logits, grad
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"in_force": in_force, "faults": faults}))
"""
PAGES = (48 << 20) // 4096  # pages of the 48 MiB block alone


def run_probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="not glibc")  # CI and every supported Linux run glibc
def test_retain_reuses_the_pages_of_freed_large_tensors_and_system_does_not():
    retain, system = run_probe("retain"), run_probe("system")
    assert retain["in_force"] == "retain" and system["in_force"] == "system"
    assert retain["faults"][0] >= PAGES  # the first round touches new memory in both modes
    # retain: the heap grows while memalign'd blocks do not yet fit the holes the last round left (seen: 7 rounds
    # here, 2-3 steps of gpt_125m), then every round reuses the same pages
    assert sum(retain["faults"][-4:]) < PAGES // 100, retain["faults"]
    # glibc as it is: the 48 MiB block is mapped anew in (nearly) every round (seen: one round in four reused the
    # heap top instead, faulting in only the small block)
    assert sum(system["faults"][-4:]) >= 3 * PAGES, system["faults"]


def test_auto_retains_on_the_cpu_only_and_bad_modes_are_refused():
    assert host_memory.resolve("auto", "cpu") == "retain"
    assert host_memory.resolve("auto", "cuda") == "system"
    assert host_memory.resolve("system", "cpu") == "system"
    assert host_memory.resolve("retain", "cuda") == "retain"
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        host_memory.apply("auto")


def test_retain_without_glibc_says_it_is_not_in_force(monkeypatch):
    # musl or macOS: no mallopt to call; the Trainer prints this line (a warning) on rank 0 and records it
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    in_force = host_memory.apply("retain")
    assert in_force == "system (train.host_malloc=retain needs glibc's mallopt; this C library has none)"
