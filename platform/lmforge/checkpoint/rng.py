"""RNG states as tensors, so they travel through DCP (no pickles). Keys are per rank."""
from __future__ import annotations

import random
from typing import Dict

import numpy as np
import torch


def rng_state_tensors(rank: int) -> Dict[str, torch.Tensor]:
    py_version, py_state, _ = random.getstate()
    np_state = np.random.get_state()
    out = {
        f"rng/rank{rank}/python": torch.tensor(list(py_state), dtype=torch.int64),
        f"rng/rank{rank}/numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
        f"rng/rank{rank}/numpy_pos": torch.tensor([np_state[2], np_state[3]], dtype=torch.float64),
        f"rng/rank{rank}/torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out[f"rng/rank{rank}/torch_cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state_tensors(state: Dict[str, torch.Tensor], rank: int) -> None:
    p = f"rng/rank{rank}/"
    if p + "python" in state:
        random.setstate((3, tuple(int(x) for x in state[p + "python"].tolist()), None))
    if p + "numpy_keys" in state:
        pos = state[p + "numpy_pos"].tolist()
        np.random.set_state(("MT19937", state[p + "numpy_keys"].numpy().astype(np.uint32), int(pos[0]), 0, pos[1]))
    if p + "torch_cpu" in state:
        torch.set_rng_state(state[p + "torch_cpu"].to(torch.uint8))
    if p + "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state[p + "torch_cuda"].to(torch.uint8))
