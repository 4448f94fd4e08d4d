"""DeepSpeed checkpoint files are loaded with weights_only=True and an exact allow-list; formats never mix silently."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lmforge.checkpoint.manager import CheckpointError, CheckpointManager
from lmforge.config.checkpoint import CheckpointConfig


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_weights_only_loads_refuses_arbitrary_objects_and_allows_deepspeed_types(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from lmforge.checkpoint.deepspeed_io import weights_only_loads
    from lmforge.checkpoint.safe_io import UnsafeCheckpointError

    bad, good = tmp_path / "bad.pt", tmp_path / "good.pt"
    torch.save({"w": torch.ones(2), "evil": Exploit()}, bad)
    torch.save({"w": torch.ones(2), "loss_scaler": LossScaler(1.0)}, good)
    with weights_only_loads():
        with pytest.raises(
            UnsafeCheckpointError, match=rf"checkpoint file {bad}: refused: .*GLOBAL posix.system .*Fix: "
        ):
            torch.load(bad, weights_only=False)  # DeepSpeed's own call style: overridden
        loaded = torch.load(good, weights_only=False)
    assert isinstance(loaded["loss_scaler"], LossScaler) and loaded["w"].sum() == 2
    assert torch.load is torch.serialization.load  # restored afterwards


def test_native_engine_refuses_a_deepspeed_checkpoint_with_the_conversion_command(tmp_path):
    ckpt = tmp_path / "step-00000003"
    ckpt.mkdir()
    (ckpt / "state.json").write_text(json.dumps({"step": 3, "format": "deepspeed", "world_size": 2}))
    (ckpt / "COMPLETE").write_text("3")
    with pytest.raises(
        CheckpointError,
        match=r"DeepSpeed format but this run uses the native engine.*"
        r"lmforge ckpt convert .*step-00000003 OUT --to native",
    ):
        CheckpointManager(tmp_path, CheckpointConfig()).load(ckpt, torch.nn.Linear(2, 2), None)
