"""The lm-eval adapter's arguments and its changes to lm-eval (interop/lm_eval_model.py, interop/lm_eval_hooks.py),
in one process against lm-eval's own parser and task loader; tests/e2e/test_lm_eval_adapter.py runs the command."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict

import pytest
import torch
from lm_eval._cli import HarnessCLI

from lmforge.config.errors import ActionableError
from lmforge.evaluation.tasks import SHIPPED_DIR
from lmforge.interop import lm_eval_hooks
from lmforge.interop.lm_eval_model import merged_args, resolve_cli_args


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with one checkpoint of a 2-layer model whose run said train.device=auto."""
    from lmforge.checkpoint.manager import CheckpointManager
    from lmforge.config.checkpoint import CheckpointConfig
    from lmforge.config.model import ModelConfig
    from lmforge.model.gpt import GPT

    root = tmp_path_factory.mktemp("lm-eval-args") / "run"
    cfg = ModelConfig(name="t", vocab_size=256, d_model=16, n_layers=2, n_heads=2, seq_len=32)
    model = GPT(cfg)
    model.init_weights(0)
    sidecar = {"config": {"model": asdict(cfg), "train": {"device": "auto"}}, "world_size": 1}
    CheckpointManager(root / "checkpoints", CheckpointConfig()).save(1, model, None, sidecar)
    return root


def parsed(monkeypatch, *argv):
    """lm-eval's own parse of a command line (its legacy form: no ``run`` subcommand)."""
    monkeypatch.setattr(sys, "argv", ["lm_eval_model", *argv])
    return HarnessCLI().parse_args()


HERE = "cuda" if torch.cuda.is_available() else "cpu"  # the run said auto: CUDA where this machine has it


@pytest.mark.parametrize(
    "flags, batch_size, device",
    [
        (["--model_args", "path=RUN,batch_size=16"], "16", HERE),  # as docs/evaluation.md writes it
        (["--model_args", "path=RUN", "--batch_size", "8", "--device", "cpu"], "8", "cpu"),  # lm-eval's flags
        (["--model_args", "path=RUN,device=cpu", "--batch_size", "4"], "4", "cpu"),  # mixed
        (["--model_args", "path=RUN,batch_size=8", "--batch_size", "8"], "8", HERE),  # both ways, agreeing
        (["--model_args", "path=RUN"], "16", HERE),  # neither: lmforge's defaults
    ],
)
def test_batch_size_and_device_either_way(flags, batch_size, device, run_dir, monkeypatch):
    args = parsed(monkeypatch, "--model", "lmforge", "--tasks", "stdlib_next_line", *flags)
    args.model_args["path"] = str(run_dir)
    resolve_cli_args(args)
    assert (args.batch_size, args.device) == (batch_size, device)
    assert args.model_args == {"path": str(run_dir), "batch_size": batch_size, "device": device}
    assert args.include_path == [str(SHIPPED_DIR)]
    # what lm-eval then hands the model: --model_args and its flags, which no longer collide
    from lm_eval.config.evaluate_config import EvaluatorConfig

    cfg = EvaluatorConfig.from_cli(args)
    assert merged_args(cfg.model_args, {"batch_size": cfg.batch_size, "device": cfg.device}) == args.model_args


def test_disagreeing_and_missing_arguments_are_one_line(run_dir, monkeypatch):
    args = parsed(monkeypatch, "--model", "lmforge", "--model_args", f"path={run_dir},batch_size=16", "-b", "8")
    with pytest.raises(ActionableError) as err:
        resolve_cli_args(args)
    assert str(err.value) == "--model_args batch_size=16: disagrees with --batch_size 8. Fix: give batch_size once"
    args = parsed(monkeypatch, "--model", "lmforge", "--model_args", "batch_size=16", "--tasks", "x")
    with pytest.raises(ActionableError) as err:
        resolve_cli_args(args)
    assert str(err.value) == "--model_args: path is missing. Fix: pass --model_args path=RUN_DIR_OR_CHECKPOINT"
    # negative control: lm-eval's own constructor path fails on the documented form (why the adapter merges)
    from lm_eval.api.model import TemplateLM

    with pytest.raises(TypeError, match="multiple values for keyword argument 'batch_size'"):
        TemplateLM.create_from_arg_obj.__func__(dict, {"batch_size": 16}, {"batch_size": 1, "device": "cuda:0"})


def test_shipped_task_data_resolve_against_the_task_file_from_any_directory(tmp_path, monkeypatch):
    import lm_eval.tasks._factory as factory
    import lm_eval.tasks._yaml_loader as yaml_loader

    monkeypatch.chdir(tmp_path)
    task = SHIPPED_DIR / "stdlib_next_line.yaml"
    cfg = yaml_loader.load_yaml(task)  # installed on import of the adapter
    assert cfg["dataset_kwargs"]["data_files"] == {"test": str(SHIPPED_DIR / "stdlib_next_line.jsonl")}
    assert factory.load_yaml is yaml_loader.load_yaml
    lm_eval_hooks.install()  # idempotent: not wrapped twice
    assert yaml_loader.load_yaml(task) == cfg
    # absolute paths, URLs and hub datasets' own data_files are left as they are
    base = tmp_path / "tasks"
    assert lm_eval_hooks.task_relative(["a.jsonl", "/abs/b.jsonl", "hf://x/c.jsonl"], base) == [
        str(base / "a.jsonl"),
        "/abs/b.jsonl",
        "hf://x/c.jsonl",
    ]
    hub = {"dataset_path": "allenai/ai2_arc", "dataset_kwargs": {"data_files": {"test": "test.jsonl"}}}
    assert lm_eval_hooks.with_task_relative_data(hub, base / "t.yaml") == hub


def git(cwd, *argv):
    subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True)


def test_git_provenance_is_quiet_outside_a_checkout_and_says_real_failures(tmp_path, monkeypatch, capfd):
    import lm_eval.evaluator as evaluator

    fallback = lambda cwd: f"read-from:{cwd}"  # noqa: E731 - lm-eval's .git file reading, here a marker
    monkeypatch.chdir(tmp_path)
    assert lm_eval_hooks.git_commit_hash(fallback) == f"read-from:{tmp_path}"
    assert evaluator.get_git_commit_hash() is None  # the installed one: lm-eval's fallback finds no .git
    assert capfd.readouterr().err == ""  # no "fatal: not a git repository"
    git(tmp_path, "init", "-q")  # a checkout with no commit: git fails for another reason, which is shown
    assert lm_eval_hooks.git_commit_hash(fallback) == f"read-from:{tmp_path}"
    err = capfd.readouterr().err
    assert err.startswith("fatal: ") and "not a git repository" not in err
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert lm_eval_hooks.git_commit_hash(fallback) == head


def test_the_command_line_stops_on_a_disagreement_with_one_line_and_exit_2(run_dir, monkeypatch, capsys):
    from lmforge.interop.lm_eval_model import main

    argv = ["--model", "lmforge", "--model_args", f"path={run_dir},device=cpu", "--device", "cuda", "--tasks", "t"]
    monkeypatch.setattr(sys, "argv", ["lm_eval_model", *argv])
    assert main() == 2
    assert capsys.readouterr().err.splitlines() == [
        "lmforge lm-eval: --model_args device=cpu: disagrees with --device cuda. Fix: give device once"
    ]
