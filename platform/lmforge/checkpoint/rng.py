"""RNG states as tensors, so they travel through DCP (no pickles). Keys are per rank.

Each generator's whole state round-trips, so the draws after a resume are exactly the draws without one:

- Python ``random``: the 625-word Mersenne Twister state and ``gauss_next`` (the second value of the last
  ``random.gauss()`` pair), as ``python`` (int64) and ``python_gauss`` (float64 ``[has_value, value]``);
- numpy's global generator: the 624 keys, the position, ``has_gauss`` and ``cached_gaussian`` (the second value of
  the last ``np.random.randn()`` pair), as ``numpy_keys`` (int64), ``numpy_pos`` (float64 ``[pos, has_gauss]``)
  and ``numpy_gauss`` (float64 ``[cached_gaussian]``);
- torch's CPU generator (its state includes the cached normal samples) and, where CUDA is present, the current
  device's generator, as uint8 tensors.

lmforge draws from no ``np.random.default_rng`` generator in training; a new one must be added here.
A checkpoint written before ``python_gauss``/``numpy_gauss`` existed loads without them (``loadable_rng_state``
says so): its generators resume with no cached Gaussian, as they were restored then.
"""

from __future__ import annotations

import random
from typing import Dict, Iterable, List, Tuple

import numpy as np
import torch


def rng_state_tensors(rank: int) -> Dict[str, torch.Tensor]:
    py_version, py_state, gauss_next = random.getstate()
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    p = f"rng/rank{rank}/"
    out = {
        p + "python": torch.tensor(list(py_state), dtype=torch.int64),
        p + "python_gauss": torch.tensor(
            [0.0 if gauss_next is None else 1.0, 0.0 if gauss_next is None else gauss_next], dtype=torch.float64
        ),
        p + "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        p + "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.float64),
        p + "numpy_gauss": torch.tensor([cached_gaussian], dtype=torch.float64),
        p + "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out[p + "torch_cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state_tensors(state: Dict[str, torch.Tensor], rank: int) -> None:
    p = f"rng/rank{rank}/"
    if p + "python" in state:
        has, value = state[p + "python_gauss"].tolist() if p + "python_gauss" in state else (0.0, 0.0)
        random.setstate((3, tuple(int(x) for x in state[p + "python"].tolist()), value if has else None))
    if p + "numpy_keys" in state:
        pos, has_gauss = state[p + "numpy_pos"].tolist()
        cached = state[p + "numpy_gauss"].tolist()[0] if p + "numpy_gauss" in state else 0.0
        has_gauss = has_gauss if p + "numpy_gauss" in state else 0
        np.random.set_state(
            ("MT19937", state[p + "numpy_keys"].numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached))
        )
    if p + "torch_cpu" in state:
        torch.set_rng_state(state[p + "torch_cpu"].to(torch.uint8))
    if p + "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[p + "torch_cuda"].to(torch.uint8))


def loadable_rng_state(rank: int, saved_keys: Iterable[str]) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """This rank's RNG tensors to load from a checkpoint holding ``saved_keys``, and the ones it lacks."""
    saved = set(saved_keys)
    state = rng_state_tensors(rank)
    missing = sorted(k for k in state if k not in saved)
    return {k: v for k, v in state.items() if k in saved}, missing


def announce_missing(path: object, missing: List[str]) -> None:
    """Say which RNG entries an older checkpoint lacks (their generators resume without them)."""
    if missing:
        import sys

        print(
            f"lmforge: warning: checkpoint {path} has no {', '.join(missing)} (written by an older lmforge): "
            "those RNG states are not restored (cached Gaussians start empty)",
            file=sys.stderr,
            flush=True,
        )
