"""RNG states round-trip exactly through a real checkpoint, including the cached Gaussians, stored as tensors only.

Python's ``random.gauss`` and numpy's legacy ``randn`` produce normals in pairs and cache the second value
(``gauss_next``; ``has_gauss``/``cached_gaussian``): a restore that drops the cache shifts every later normal draw.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lmforge.checkpoint.manager import CheckpointManager
from lmforge.checkpoint.safe_io import tensor_metadata
from lmforge.config.checkpoint import CheckpointConfig

N = 7


def draws() -> tuple:
    """N values of every generator, uniform and normal (odd counts, so a cache is left behind again)."""
    out = (
        [random.random() for _ in range(N)] + [random.gauss(0.0, 1.0) for _ in range(N)],
        np.random.rand(N).tolist() + [float(np.random.randn()) for _ in range(N)],
        torch.rand(N).tolist() + torch.randn(N).tolist() + [float(torch.randn(1)) for _ in range(N)],
    )
    if torch.cuda.is_available():  # the CUDA generator of this device, when there is one
        out += (torch.rand(N, device="cuda").tolist() + torch.randn(N, device="cuda").tolist(),)
    return out


def test_rng_state_round_trips_exactly_through_a_manager_checkpoint(tmp_path):
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    random.gauss(0.0, 1.0)  # leaves gauss_next cached
    np.random.randn()  # an odd draw: leaves cached_gaussian
    float(torch.randn(1))
    assert random.getstate()[2] is not None and np.random.get_state()[3] == 1
    saved_np = np.random.get_state()
    path = mgr.save(1, model, None, {"world_size": 1}).path
    first = draws()

    mgr.load(path, model, None)
    restored_np = np.random.get_state()
    assert restored_np[3] == saved_np[3] and restored_np[4] == saved_np[4] and restored_np[2] == saved_np[2]
    assert draws() == first

    # Negative control: the same restore with the cached Gaussians dropped (what a state without them does)
    # changes the next normal draws, so the equality above is what the cache round-trip buys.
    mgr.load(path, model, None)
    random.setstate(random.getstate()[:2] + (None,))
    np.random.set_state(np.random.get_state()[:3] + (0, 0.0))
    again = draws()
    assert again[0][:N] == first[0][:N] and again[0][N:] != first[0][N:]
    assert again[1][:N] == first[1][:N] and again[1][N:] != first[1][N:]

    # Stored as tensors (DCP), nothing pickled: every rng entry is a tensor in the index.
    rng = {k: v for k, v in tensor_metadata(path).items() if k.startswith("rng/")}
    assert {k.split("/")[-1] for k in rng} >= {
        "python",
        "python_gauss",
        "numpy_keys",
        "numpy_pos",
        "numpy_gauss",
        "torch_cpu",
    }
    assert all(isinstance(v, TensorStorageMetadata) for v in rng.values())


def test_an_older_checkpoint_without_the_gaussian_caches_is_named_not_silently_half_restored(capsys):
    from lmforge.checkpoint.rng import announce_missing, loadable_rng_state

    old = ["rng/rank0/python", "rng/rank0/numpy_keys", "rng/rank0/numpy_pos", "rng/rank0/torch_cpu"]
    state, missing = loadable_rng_state(0, old)
    assert sorted(state) == sorted(old) and missing == ["rng/rank0/numpy_gauss", "rng/rank0/python_gauss"]
    announce_missing("ckpt/step-00000001", missing)
    assert capsys.readouterr().err.strip() == (
        "lmforge: warning: checkpoint ckpt/step-00000001 has no rng/rank0/numpy_gauss, rng/rank0/python_gauss "
        "(written by an older lmforge): those RNG states are not restored (cached Gaussians start empty)"
    )
    assert loadable_rng_state(0, old + missing)[1] == []  # a current checkpoint lacks nothing
