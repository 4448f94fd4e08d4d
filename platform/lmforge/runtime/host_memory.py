"""What the process's C allocator does with freed memory (``train.host_malloc``), set once per process.

glibc's malloc serves every block above its mmap threshold (which never rises past 32 MiB on 64-bit) with a
fresh ``mmap`` and unmaps it again on ``free``, and gives the top of its heap back to the kernel once more than
the trim threshold is free there. On a CPU training step the large tensors (the logits and their gradient, the
embedding's dense gradient and its sum with the tied head's) are freed at the end of every step, so the next step
gets new pages and the kernel zero-fills each one at its first touch: gpt_125m took 230-290 k minor page faults a
step, and the ops that first touch those blocks ran 10-20x slower than on reused memory
(benchmarks/reports/2026-12-step-speed.md).

``retain`` sets ``mallopt(M_MMAP_MAX, 0)`` (every block from the heap) and ``mallopt(M_TRIM_THRESHOLD, 2**31-1)``
(the heap is never trimmed): after the first steps a step reuses the pages the previous one freed (faults per step
fall to ~0) and the process's resident memory stays at its peak instead of shrinking between steps: what the CUDA
caching allocator does for a GPU's tensors, done with the C library's own switches (no allocator to preload,
nothing to install). ``system`` leaves malloc as it is. ``auto``: ``retain`` when training on the
CPU, ``system`` on a GPU (whose tensors the CUDA caching allocator already keeps; host-side effects unmeasured).

The switches exist in glibc only: elsewhere (musl, macOS) ``retain`` changes nothing and says so.
"""

from __future__ import annotations

import ctypes
from typing import Optional

# <malloc.h>: mallopt parameters
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NEVER_TRIM = 2**31 - 1  # mallopt takes an int


def resolve(mode: str, device_type: str) -> str:
    """``train.host_malloc`` for a run on ``device_type``: ``auto`` is ``retain`` on the CPU, else ``system``."""
    if mode == "auto":
        return "retain" if device_type == "cpu" else "system"
    return mode


def _glibc() -> Optional[ctypes.CDLL]:
    """The process's C library if it is glibc (it has ``gnu_get_libc_version`` and ``mallopt``), else None."""
    libc = ctypes.CDLL(None)  # the symbols already loaded into this process: the C library's among them
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def apply(mode: str) -> str:
    """Set the allocator for ``mode`` (``retain`` or ``system``; resolve ``auto`` first) and say what is in force:
    ``retain``, ``system``, or ``system (...)`` with the reason ``retain`` could not be set."""
    if mode == "system":
        return "system"
    if mode != "retain":
        raise ValueError(f"host malloc mode {mode!r} is not retain or system (resolve 'auto' first)")
    libc = _glibc()
    if libc is None:
        return "system (train.host_malloc=retain needs glibc's mallopt; this C library has none)"
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, NEVER_TRIM) != 1:
        return "system (glibc refused mallopt(M_MMAP_MAX / M_TRIM_THRESHOLD))"
    return "retain"
