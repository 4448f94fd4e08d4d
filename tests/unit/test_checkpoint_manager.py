"""CheckpointManager in one process: retention and pins, atomic commit, async capture, model mismatch errors."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from lmforge.checkpoint import fault_injection
from lmforge.checkpoint.layout import COMPLETE, SIDECAR, complete_checkpoints, step_of, tmp_dir
from lmforge.checkpoint.manager import CheckpointError, CheckpointManager
from lmforge.checkpoint.retention import plan_retention
from lmforge.config.checkpoint import CheckpointConfig
from lmforge.config.model import ModelConfig
from lmforge.model.gpt import GPT


def tiny_gpt(d_model: int = 32, n_layers: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(
        ModelConfig(name="t", vocab_size=128, d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=2, seq_len=16)
    )


def test_plan_retention_keeps_last_every_and_pinned():
    keep, delete = plan_retention(range(1, 11), keep_last=2, keep_every=4, pinned=[3])
    assert keep == {3, 4, 8, 9, 10}
    assert delete == {1, 2, 5, 6, 7}
    keep, delete = plan_retention([5, 10, 15], keep_last=0, keep_every=0, pinned=[])
    assert keep == set() and delete == {5, 10, 15}
    keep, _ = plan_retention([5, 10, 15], keep_last=1, keep_every=0, pinned=[99])  # a pin of nothing keeps nothing
    assert keep == {15}


def test_retention_on_disk_and_pins_survive(tmp_path):
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last=2, keep_every=4))
    for step in range(1, 11):
        mgr.save(step, model, None, {"world_size": 1})
        if step == 3:
            assert mgr.pin_latest("loss spike at step 4: last good checkpoint") == tmp_path / "step-00000003"
        if step == 6:  # the fault module pins the newest checkpoint at or before a given step
            assert mgr.pin_latest("before divergence", at_or_before=5) == tmp_path / "step-00000005"
    assert [step_of(p) for p in complete_checkpoints(tmp_path)] == [3, 4, 5, 8, 9, 10]
    assert mgr.pinned() == {3: "loss spike at step 4: last good checkpoint", 5: "before divergence"}
    mgr.unpin(tmp_path / "step-00000005")
    mgr.save(11, model, None, {"world_size": 1})
    assert [step_of(p) for p in complete_checkpoints(tmp_path)] == [3, 4, 8, 10, 11]
    assert not list(tmp_path.glob(".tmp-step-*"))


def test_at_steps_checkpoints_outlive_keep_last(tmp_path):
    """The starts of cooldown branches (checkpoint.at_steps) stay however many newer saves follow."""
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last=1, at_steps=[2, 5]))
    for step in range(1, 8):
        mgr.save(step, model, None, {"world_size": 1})
    assert [step_of(p) for p in complete_checkpoints(tmp_path)] == [2, 5, 7]
    control = CheckpointManager(tmp_path / "control", CheckpointConfig(keep_last=1))
    for step in range(1, 8):
        control.save(step, model, None, {"world_size": 1})
    assert [step_of(p) for p in complete_checkpoints(tmp_path / "control")] == [7]


def test_partial_save_is_never_resolved(tmp_path):
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last=3))
    mgr.save(2, model, None, {"world_size": 1})
    partial = tmp_dir(tmp_path, 4)
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    (tmp_path / "step-00000006").mkdir()  # a final name without COMPLETE is not a checkpoint either
    assert mgr.resolve("auto") == tmp_path / "step-00000002"
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        mgr.resolve(str(partial))


def test_crash_before_commit_leaves_previous_latest(tmp_path):
    model = torch.nn.Linear(4, 4)
    mgr = CheckpointManager(tmp_path, CheckpointConfig(keep_last=3))
    mgr.save(1, model, None, {"world_size": 1})

    def crash(stage, step, final):
        if stage == "shards" and step == 2:
            raise KeyboardInterrupt("killed between shards and commit")

    fault_injection.install_commit_hook(crash)  # the test's own hook (production reads no test setting)
    try:
        with pytest.raises(KeyboardInterrupt):
            mgr.save(2, model, None, {"world_size": 1})
    finally:
        fault_injection.install_commit_hook(None)
    assert (tmp_dir(tmp_path, 2) / ".metadata").exists() and not (tmp_dir(tmp_path, 2) / COMPLETE).exists()
    assert mgr.resolve("auto") == tmp_path / "step-00000001"


def test_roundtrip_restores_model_optimizer_rng_and_sidecar(tmp_path):
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 128, (2, 16))).sum().backward()
    opt.step()
    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    mgr.save(5, model, opt, {"world_size": 1, "wandb_run_id": "abc123", "scheduler": {"step": 5}})
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}

    model2 = tiny_gpt()
    for p in model2.parameters():
        p.data.add_(1.0)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    side = mgr.load(tmp_path / "step-00000005", model2, opt2)
    assert side["step"] == 5 and side["wandb_run_id"] == "abc123" and side["scheduler"] == {"step": 5}
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect
    for k, v in model2.state_dict().items():
        assert torch.equal(v, ref[k]), k
    got_opt = opt2.state[next(iter(model2.parameters()))]
    for k, v in ref_opt.items():
        assert torch.equal(got_opt[k], v), k
    # The sidecar is plain JSON, nothing pickled.
    assert json.loads((tmp_path / "step-00000005" / SIDECAR).read_text())["wandb_run_id"] == "abc123"


def test_async_thread_save_captures_state_at_call_and_commits_on_wait(tmp_path):
    model = torch.nn.Linear(8, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mgr = CheckpointManager(tmp_path, CheckpointConfig(async_mode="thread"))
    result = mgr.save(3, model, None, {"world_size": 1})
    assert not result.committed and result.stall_s >= 0
    with torch.no_grad():  # training goes on while the write runs
        model.weight.add_(5.0)
    assert mgr.resolve("auto") is None and mgr.pending is not None  # invisible until committed
    assert mgr.wait() == tmp_path / "step-00000003"
    fresh = torch.nn.Linear(8, 8)
    mgr.load(tmp_path / "step-00000003", fresh, None)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_incompatible_model_names_mismatched_tensors(tmp_path):
    mgr = CheckpointManager(tmp_path, CheckpointConfig())
    mgr.save(1, tiny_gpt(d_model=32, n_layers=2), None, {"world_size": 1})
    wider = tiny_gpt(d_model=48, n_layers=3)
    with pytest.raises(CheckpointError) as err:
        mgr.load(tmp_path / "step-00000001", wider, None)
    text = str(err.value)
    assert "does not fit this model" in text
    name = next(k for k in wider.state_dict() if "emb" in k)
    assert f"{name}: checkpoint [128, 32] vs model [128, 48]" in text
    assert "layers.2." in text and "missing from the checkpoint" in text
    assert "Fix: resume with the model config the checkpoint was saved with" in text


def test_resume_load_never_unpickles_arbitrary_objects(tmp_path):
    """A checkpoint whose non-tensor entry holds a pickled callable is refused on load, not executed."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from lmforge.checkpoint.safe_io import SafeLoadPlanner, UnsafeCheckpointError

    class Boom:
        def __reduce__(self):
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save({"x": Boom()}, buf)
    buf.seek(0)
    planner = SafeLoadPlanner()
    planner.flatten_state_dict = False
    planner.state_dict = {}
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("k"),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex("k"),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"\(DCP entry 'k'\): refused: .*Unsupported global: GLOBAL "
        r"print was not an allowed global.*Fix: ",
    ):
        planner.load_bytes(item, buf)
    ok = io.BytesIO()
    torch.save({"lr": 0.1, "betas": (0.9, 0.95), "params": ["a.weight"]}, ok)
    ok.seek(0)
    planner.load_bytes(item, ok)
    assert planner.state_dict["k"] == {"lr": 0.1, "betas": (0.9, 0.95), "params": ["a.weight"]}


def _stage_of(model: GPT) -> GPT:
    """What parallel/pipeline.prune_to_rank leaves of ``model`` for the first of two stages: layer 0 and the
    embedding, no final norm or output projection; the remaining weights zeroed."""
    del model.layers["1"]
    model.norm = None
    model.output = None
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def test_pipeline_stage_layout_loads_its_tensors_and_expects_the_other_stages(tmp_path):
    from lmforge.checkpoint.safe_io import read_json
    from lmforge.checkpoint.state_io import DcpStateIO

    full = tiny_gpt()
    path = CheckpointManager(tmp_path, CheckpointConfig()).save(1, full, None, {"world_size": 1}).path
    sidecar = read_json(path / SIDECAR)
    stage = _stage_of(tiny_gpt())
    DcpStateIO(stage, None, pipeline_stage=True).load(path, sidecar)  # what a pp > 1 engine's StateLayout says
    ref = full.state_dict()
    assert set(stage.state_dict()) and all(torch.equal(v, ref[k]) for k, v in stage.state_dict().items())
    with pytest.raises(CheckpointError, match=r"layers\.1\..*in the checkpoint but not in the model"):
        DcpStateIO(_stage_of(tiny_gpt()), None, pipeline_stage=False).load(path, sidecar)  # negative control


def test_optimizer_hyperparameters_are_saved_per_parameter_name_and_indexed_groups_still_load(tmp_path):
    """Param groups go in per parameter name (``optim.param_groups.<name>.lr``): pipeline ranks hold different
    parameters in their groups, and under a group index (``optim.param_groups.0``) DCP keeps one rank's list, so a
    pipeline checkpoint did not resume under pipelining. A checkpoint with indexed groups (saved before) loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from lmforge.checkpoint.safe_io import tensor_metadata
    from lmforge.checkpoint.state_io import DcpStateIO, has_indexed_param_groups

    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 128, (2, 16))).sum().backward()
    opt.step()
    path = CheckpointManager(tmp_path / "named", CheckpointConfig()).save(1, model, opt, {"world_size": 1}).path
    keys = set(tensor_metadata(path))
    assert "optim.param_groups.layers.0.attention.wq.weight.lr" in keys and not has_indexed_param_groups(path)
    indexed = tmp_path / "indexed"
    msd, osd = get_state_dict(model, opt)  # the optimizer's own layout: groups by index, each with its params
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(indexed))
    assert "optim.param_groups.0.lr" in set(tensor_metadata(indexed)) and has_indexed_param_groups(indexed)
    for saved in (path, indexed):
        model2 = tiny_gpt()
        opt2 = torch.optim.AdamW(model2.parameters(), lr=5e-4)
        DcpStateIO(model2, opt2).load(saved, {"world_size": 1}, restore_rng=False)
        assert opt2.param_groups[0]["lr"] == 1e-3, saved.name
        first, first2 = next(iter(model.parameters())), next(iter(model2.parameters()))
        assert torch.equal(opt2.state[first2]["exp_avg"], opt.state[first]["exp_avg"]), saved.name


def _contract_members(protocol) -> set:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {
        n for n, v in vars(protocol).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }
    return names


def _missing_members(cls, protocol) -> list:
    """Members of ``protocol`` that ``cls`` neither defines nor assigns in its methods (``self.<name> = ...``, also
    as one target of a tuple assignment)."""
    import inspect
    import re

    source = inspect.getsource(cls)
    target = r"(?:self\.\w+|_)"
    assigned = {
        n
        for n in _contract_members(protocol)
        if re.search(rf"^\s*(?:{target}\s*,\s*)*self\.{n}\s*(?:,\s*{target}\s*)*=(?!=)", source, re.M)
    }
    return sorted(n for n in _contract_members(protocol) if not hasattr(cls, n) and n not in assigned)


def test_both_engines_offer_every_member_of_the_engine_contract():
    from lmforge.checkpoint.manager import STATE_IO
    from lmforge.parallel.contract import FORMATS, Engine, OwnFilesState, StateLayout
    from lmforge.parallel.deepspeed_engine import DeepSpeedEngine
    from lmforge.parallel.native_engine import NativeEngine

    assert {
        "train_step",
        "eval_loss",
        "state_layout",
        "dp_group",
        "dp_rank",
        "inner",
        "optimizer",
    } <= _contract_members(Engine)
    assert _missing_members(NativeEngine, Engine) == []
    assert _missing_members(DeepSpeedEngine, Engine) == []
    assert _missing_members(DeepSpeedEngine, OwnFilesState) == []
    assert "state_layout" in _missing_members(torch.nn.Linear, Engine)  # negative control: not an engine
    assert set(STATE_IO) == set(FORMATS)  # the checkpoint layer reads every format an engine may report
    with pytest.raises(ValueError, match="StateLayout.format='zarr'"):
        StateLayout("zarr")
