"""train.host_malloc=retain measured in fresh processes: the page faults of rounds that free and re-allocate
large tensors (a process of its own: the test session's heap would hide them)."""

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
