"""train.host_malloc (runtime/host_memory.py): with ``retain`` a process that frees and re-allocates large
tensors, as every CPU training step does with its logits and gradients, reuses the same pages once its heap has
grown to fit them (no page faults in the last rounds); with ``system`` (glibc as it is, the negative control) the
block over glibc's mmap threshold is faulted in anew every round. Each mode runs in a fresh process: the switches
are process-wide and cannot be undone."""

from __future__ import annotations

import pytest

from lmforge.runtime import host_memory


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
