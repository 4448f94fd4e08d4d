"""No load path unpickles: a malicious payload planted in any checkpoint or state file is refused, never run.

One real 1-rank DeepSpeed ZeRO-1 run (``python -m lmforge.train``, one step, checkpointed) writes DeepSpeed's own
``.pt`` files, the RNG tensors (DCP) and the JSON sidecar; ``lmforge ckpt convert --to native`` turns it into a
native DCP checkpoint (model, AdamW state with its ``param_groups`` byte entries, RNG). Each row copies one of the
two, plants a payload whose unpickling writes a marker file (``builtins.exec``) into one file, runs one load path
and asserts a one-line refusal naming the file, the reason and the fix (exit 2 where the path is a CLI) and no
marker. The negative controls: each path loads the honest checkpoint, and the stock readers do run the payload.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import free_port

os.environ.setdefault("DS_ACCELERATOR", "cpu")

COMMON = [
    "model=tiny",
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.eval_every=0",
    "train.threads=1",
    "train.precision=fp32",
    "train.device=cpu",
    "logging.console=plain",
    "checkpoint.every_steps=1",
    "parallelism=zero1",
    "parallelism.dp_replicate=1",
]
STEP = "step-00000001"
DS_MODEL, DS_OPTIM = "deepspeed/mp_rank_00_model_states.pt", "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt"


class Payload:
    """Unpickling this runs ``exec``, which writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __copy__(self):  # copies keep the payload (planting must not run it)
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('payload ran')",))


def ds_env() -> dict:
    return {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "DS_ACCELERATOR": "cpu",
    }


def train(root: Path, name: str, extra, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lmforge.train", f"run.root={root}", f"run.name={name}", *COMMON, *extra]
    return subprocess.run(cmd, cwd=root, env=ds_env(), capture_output=True, text=True, timeout=timeout)


def cli(args, capsys) -> tuple:
    from lmforge.cli import main

    rc = main(args)
    out = capsys.readouterr()
    return rc, out.err.strip()


@pytest.fixture(scope="module")
def built(tmp_path_factory, data_cache):
    root = tmp_path_factory.mktemp("loadsafe")
    proc = train(root, "ds", ["train.max_steps=1"])
    ds = root / "ds" / "checkpoints" / STEP
    assert proc.returncode == 0 and (ds / "COMPLETE").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    from lmforge.cli import main  # the convert path's negative control: an honest DeepSpeed checkpoint converts

    assert main(["ckpt", "convert", str(ds), str(root / "native"), "--to", "native"]) == 0
    return {"root": root, "ds": ds, "native": root / "native" / STEP}


# ---- planting -------------------------------------------------------------------------------------------------


def plant_file(name: str):
    def plant(ckpt: Path, marker: Path) -> str:
        (ckpt / name).write_bytes(pickle.dumps(Payload(marker)))
        return name

    return plant


def plant_torch_file(name: str):
    def plant(ckpt: Path, marker: Path) -> str:
        torch.save({"module": Payload(marker), "w": torch.ones(2)}, ckpt / name)
        return Path(name).name

    return plant


def plant_byte_entry(ckpt: Path, marker: Path) -> str:
    """Re-save the native checkpoint with the optimizer's lr (a DCP byte entry) replaced by the payload."""
    from lmforge.checkpoint.manager import CheckpointManager
    from lmforge.checkpoint.safe_io import read_json
    from lmforge.config.checkpoint import CheckpointConfig

    side = read_json(ckpt / "state.json")
    model, opt = _model_and_optimizer(side)
    CheckpointManager(ckpt.parent, CheckpointConfig()).load(ckpt, model, opt)
    opt.param_groups[0]["lr"] = Payload(marker)
    shutil.rmtree(ckpt)
    CheckpointManager(ckpt.parent, CheckpointConfig()).save(side.pop("step"), model, opt, side)
    return "DCP entry 'optim.param_groups."


def _model_and_optimizer(side: dict):
    from lmforge.checkpoint.weights import model_config_from_dict
    from lmforge.model.gpt import GPT
    from lmforge.optim.adamw import build_optimizer_from_dict

    model = GPT(model_config_from_dict(side["config"]["model"], "test"))
    return model, build_optimizer_from_dict(model, side["config"]["optim"])


# ---- load paths ------------------------------------------------------------------------------------------------
# Each returns the refusal line (CLI paths: after asserting exit 2) or raises the path's own error type.


def native_resume(ckpt: Path, capsys, root: Path, built: dict) -> str:
    from lmforge.checkpoint.manager import CheckpointManager
    from lmforge.checkpoint.safe_io import UnsafeCheckpointError, read_json
    from lmforge.config.checkpoint import CheckpointConfig

    try:
        model, opt = _model_and_optimizer(read_json(built["native"] / "state.json"))
        CheckpointManager(ckpt.parent, CheckpointConfig()).load(ckpt, model, opt)
    except UnsafeCheckpointError as e:
        return str(e)
    return ""


def init_from(ckpt: Path, capsys, root: Path, built: dict) -> str:
    from lmforge.checkpoint.weights import checkpoint_model_config, load_model_weights
    from lmforge.config.errors import ConfigError
    from lmforge.model.gpt import GPT

    cfg = checkpoint_model_config(built["native"])  # this run's model: the honest checkpoint's
    try:
        load_model_weights(ckpt, GPT(cfg), cfg)
    except ConfigError as e:
        assert str(e).startswith("config key 'train.init_from': "), e
        return str(e)
    return ""


def export_hf(ckpt: Path, capsys, root: Path, built: dict) -> str:
    out = root / f"hf-{ckpt.parent.name}"
    rc, err = cli(["export", "hf", str(ckpt), str(out), "--no-tokenizer"], capsys)
    if rc == 0:
        assert (out / "model.safetensors").exists()
        return ""
    assert rc == 2 and err.startswith("lmforge export: "), (rc, err)
    return err


def convert(ckpt: Path, capsys, root: Path, built: dict) -> str:
    rc, err = cli(["ckpt", "convert", str(ckpt), str(root / f"conv-{ckpt.parent.name}"), "--to", "native"], capsys)
    if rc == 0:
        return ""
    assert rc == 2 and err.startswith("lmforge ckpt convert: "), (rc, err)
    return err


ROWS = {  # row: (source checkpoint, plant, path, what the refusal names)
    "native-resume/.metadata": ("native", plant_file(".metadata"), native_resume, ".metadata"),
    "native-resume/byte-entry": ("native", plant_byte_entry, native_resume, None),
    "native-resume/sidecar": ("native", plant_file("state.json"), native_resume, "state.json"),
    "init_from/.metadata": ("native", plant_file(".metadata"), init_from, ".metadata"),
    "init_from/sidecar": ("native", plant_file("state.json"), init_from, "state.json"),
    "export-hf/.metadata": ("native", plant_file(".metadata"), export_hf, ".metadata"),
    "export-hf/sidecar": ("native", plant_file("state.json"), export_hf, "state.json"),
    "convert/model-states.pt": ("ds", plant_torch_file(DS_MODEL), convert, "mp_rank_00_model_states.pt"),
    "convert/optim-states.pt": ("ds", plant_torch_file(DS_OPTIM), convert, "optim_states.pt"),
    "convert/rng-.metadata": ("ds", plant_file(".metadata"), convert, ".metadata"),
    "convert/sidecar": ("ds", plant_file("state.json"), convert, "state.json"),
}


def _copy(built, source: str, dst: Path) -> Path:
    ckpt = dst / "checkpoints" / STEP
    shutil.copytree(built[source], ckpt)
    return ckpt


@pytest.mark.parametrize("row", list(ROWS))
def test_planted_payload_is_refused_in_one_line_and_never_runs(row, built, tmp_path, capsys):
    source, plant, path, names = ROWS[row]
    ckpt = _copy(built, source, tmp_path / "run")
    marker = tmp_path / "MARKER"
    named = plant(ckpt, marker)
    assert not marker.exists(), "planting ran the payload"
    line = path(ckpt, capsys, tmp_path, built)
    assert not marker.exists(), f"{row}: the payload ran"
    assert line, f"{row}: the planted checkpoint was loaded"
    assert "\n" not in line, line
    assert str(ckpt) in line and (names or named) in line, line
    assert ("refused" in line or "not JSON" in line) and "Fix: " in line, line
    if "sidecar" not in row:
        assert re.search(r"\bexec\b", line), line  # the reason names the global it would have called


@pytest.mark.parametrize("path", [native_resume, init_from, export_hf, convert], ids=lambda f: f.__name__)
def test_negative_control_honest_checkpoint_loads(path, built, tmp_path, capsys):
    source = "ds" if path is convert else "native"
    ckpt = _copy(built, source, tmp_path / "run")
    assert path(ckpt, capsys, tmp_path, built) == ""


def test_negative_control_the_payloads_are_live_for_the_stock_readers(built, tmp_path):
    """The same plants do run code through DCP's stock metadata reader and DeepSpeed's own torch.load call."""
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = _copy(built, "ds", tmp_path / "run")
    plant_file(".metadata")(ckpt, tmp_path / "M1")
    with pytest.raises(Exception):  # noqa: B017 - any error: the point is that the payload ran first
        FileSystemReader(str(ckpt)).read_metadata()  # exec returns None: "not Metadata" only after it ran
    assert (tmp_path / "M1").read_text() == "payload ran"
    plant_torch_file(DS_MODEL)(ckpt, tmp_path / "M2")
    torch.load(ckpt / DS_MODEL, weights_only=False)
    assert (tmp_path / "M2").read_text() == "payload ran"


@pytest.mark.parametrize(
    "source,plant,named",
    [
        (
            "ds",
            plant_torch_file(DS_MODEL),
            DS_MODEL,
        ),  # DeepSpeed's own load_checkpoint -> torch.load(weights_only=False)
        (
            "native",
            plant_file(".metadata"),
            ".metadata",
        ),  # the way back: a DeepSpeed run continuing a native checkpoint
    ],
    ids=["deepspeed-files", "native-into-deepspeed"],
)
def test_deepspeed_resume_refuses_a_planted_file_through_the_cli(source, plant, named, built, tmp_path):
    """``lmforge train`` (DeepSpeed ZeRO-1, 1 rank) resuming the planted checkpoint: one line, exit 2, no marker."""
    ckpt = _copy(built, source, tmp_path / "run")
    marker = tmp_path / "MARKER"
    plant(ckpt, marker)
    proc = train(tmp_path, "resume", ["train.max_steps=2", f"train.resume={ckpt}"])
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not marker.exists()
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("lmforge: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"checkpoint file {ckpt / named}" in lines[0] and re.search(r"\bexec\b", lines[0]) and "Fix: " in lines[0]


def test_sweep_state_files_are_refused_without_running_anything(tmp_path, capsys):
    """Sweep resume reads sweep.json (JSON) and the collector reads config.yaml (safe YAML) and metrics.jsonl."""
    from lmforge.runtime.rundir import RunPaths
    from lmforge.scaling.collect import read_metrics, source_weights
    from lmforge.scaling.errors import ScalingError

    marker = tmp_path / "MARKER"
    (tmp_path / "sweep.json").write_bytes(pickle.dumps(Payload(marker)))
    rc, err = cli(["sweep", "status", str(tmp_path)], capsys)
    assert rc == 2 and f"{tmp_path / 'sweep.json'}: is not a JSON sweep plan" in err and "Fix: " in err, err
    run = RunPaths(tmp_path / "point")
    run.root.mkdir()
    run.config.write_text(f"data: !!python/object/apply:builtins.exec [\"open('{marker}', 'w').write('x')\"]\n")
    with pytest.raises(ScalingError, match=r"config.yaml: is not a plain YAML run config .*Fix: "):
        source_weights(run)
    run.metrics.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ScalingError, match=r"metrics.jsonl: is not JSON lines text"):
        read_metrics(run.metrics)
    assert not marker.exists()
    run.config.write_text("data:\n  sources:\n    a: {weight: 3}\n    b: {weight: 1}\n")  # control: honest files
    run.metrics.write_text('{"kind": "train", "step": 1, "loss": 2.5}\n')
    assert source_weights(run) == {"a": 0.75, "b": 0.25} and read_metrics(run.metrics)[0]["loss"] == 2.5
