"""lm-evaluation-harness's own offline run of a shipped task with ``--model lmforge``: the same accuracies and
per-choice log-likelihoods as lmforge's in-loop scorer on the checkpoint; rolling log-likelihood and
generate_until against direct computations; the command docs/evaluation.md shows, run as written on CPU from a
directory that is no git checkout."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

LIMIT = 12


@pytest.fixture()
def checkpoint(tmp_path, data_cache):
    from lmforge.checkpoint.manager import CheckpointManager
    from lmforge.config.checkpoint import CheckpointConfig
    from lmforge.config.model import ModelConfig
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.model.gpt import GPT

    cfg = ModelConfig(name="t", vocab_size=8192, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64)
    model = GPT(cfg)
    model.init_weights(5)
    with torch.no_grad():  # larger weights than the init: log-likelihoods that differ between choices
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    tok = load_tokenizer("embedded", data_cache)
    sidecar = {
        "config": {"model": asdict(cfg), "data": {"tokenizer": "embedded", "cache_dir": str(data_cache)}},
        "world_size": 1,
        "tokenizer": tok.identity,
    }
    CheckpointManager(tmp_path / "run" / "checkpoints", CheckpointConfig()).save(1, model.eval(), None, sidecar)
    return tmp_path / "run"


DOCS = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.mark.timeout(600)
def test_lm_eval_simple_evaluate_agrees_with_the_in_loop_scorer(checkpoint, tmp_path, monkeypatch):
    for key, value in {"HF_HOME": str(tmp_path / "hf"), **OFFLINE}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)  # the task's data are found from the task file, not the working directory
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    import lmforge.interop.lm_eval_model  # noqa: F401 - registers the model "lmforge"
    from lmforge.evaluation.offline import load_checkpoint, untrained_like
    from lmforge.evaluation.runner import TaskRunner
    from lmforge.evaluation.tasks import SHIPPED_DIR, load_task
    from lmforge.generation.decode import generate

    path = SHIPPED_DIR / "stdlib_next_line.yaml"
    out = lm_eval.simple_evaluate(
        model="lmforge",
        model_args=f"path={checkpoint},batch_size=8",
        tasks=["stdlib_next_line"],
        task_manager=TaskManager(include_path=str(SHIPPED_DIR)),
        limit=LIMIT,
        log_samples=True,
    )
    theirs = out["results"]["stdlib_next_line"]
    samples = sorted(out["samples"]["stdlib_next_line"], key=lambda s: s["doc_id"])

    loaded = load_checkpoint(checkpoint)
    task = load_task(path)
    runner = TaskRunner(
        [task], loaded.tokenizer.encode, eod=loaded.tokenizer.eod, seq_len=loaded.cfg.seq_len, batch_size=8, limit=LIMIT
    )
    ours, records = runner.run_fn(loaded.token_logprobs, torch.device("cpu"))
    assert theirs["acc,none"] == ours["eval/stdlib_next_line/acc"]
    assert theirs["acc_norm,none"] == ours["eval/stdlib_next_line/acc_norm"]
    assert [s["doc_id"] for s in samples] == list(range(LIMIT))
    for s, rec in zip(samples, records["stdlib_next_line"]):
        assert [r[0][0] for r in s["resps"]] == pytest.approx(rec["lls"], abs=1e-4)
    assert len({round(x, 3) for rec in records["stdlib_next_line"] for x in rec["lls"]}) > LIMIT  # not all equal
    # negative control: other weights of the same shape do not reproduce lm-eval's log-likelihoods
    _, other = runner.run_fn(untrained_like(loaded, seed=9).token_logprobs, torch.device("cpu"))
    assert [r[0][0] for r in samples[0]["resps"]] != pytest.approx(other["stdlib_next_line"][0]["lls"], abs=1e-2)

    lm = lmforge.interop.lm_eval_model.LmforgeLM(path=str(checkpoint), batch_size=4)
    text = "    def close(self):\n        return self._file.close()\n" * 8
    (rolled,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = [loaded.tokenizer.eod] + loaded.tokenizer.encode(text)
    L = loaded.cfg.seq_len
    assert len(ids) > L + 1  # more than one window
    direct = 0.0
    with torch.no_grad():
        for s in range(1, len(ids), L):  # targets ids[s:e], each window given at most L tokens of input
            e = min(s + L, len(ids))
            a = max(0, e - 1 - L)
            logp = torch.log_softmax(loaded.model(torch.tensor([ids[a : e - 1]])).double(), -1)[0]
            direct += float(sum(logp[i - a - 1, ids[i]] for i in range(s, e)))
    assert rolled == pytest.approx(direct, abs=1e-3)
    prompt = "def main():\n"
    (gen,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": ["\n\n"], "max_gen_toks": 12}), 0)])
    (ids,) = generate(loaded.model, [loaded.tokenizer.encode(prompt)], 12, eos_token_id=loaded.tokenizer.eod)
    want = loaded.tokenizer.decode([t for t in ids if t != loaded.tokenizer.eod])
    assert gen == want.split("\n\n")[0] and json.dumps(gen)


def documented_command() -> list:
    """The lm-eval command line of docs/evaluation.md (its ``python -m lmforge.interop.lm_eval_model`` block)."""
    text = DOCS.read_text()
    (block,) = re.findall(r"```(?:bash)?\n(python -m lmforge\.interop\.lm_eval_model .*?)```", text, re.S)
    return shlex.split(block.replace("\\\n", " "))


@pytest.mark.timeout(600)
def test_the_documented_lm_eval_command_runs_on_cpu_from_any_directory(checkpoint, tmp_path):
    """Run as written (python = this interpreter) in a directory holding the run as runs/smoke, which is no git
    checkout, with no GPU visible: batch_size in --model_args, the run's device (CPU here), the shipped task's data
    found beside its task file, and no git noise; the accuracy is the in-loop scorer's."""
    from lmforge.evaluation.offline import load_checkpoint
    from lmforge.evaluation.runner import TaskRunner
    from lmforge.evaluation.tasks import SHIPPED_DIR, load_task

    argv = documented_command()
    assert argv[:3] == ["python", "-m", "lmforge.interop.lm_eval_model"] and "path=runs/smoke,batch_size=16" in argv
    cwd = tmp_path / "elsewhere"
    (cwd / "runs").mkdir(parents=True)
    (cwd / "runs" / "smoke").symlink_to(checkpoint)
    assert subprocess.run(["git", "rev-parse"], cwd=cwd, capture_output=True).returncode != 0  # not a checkout
    env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "hf"), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, *argv[1:], "--output_path", str(tmp_path / "results")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not a git repository" not in done.stderr
    header = "lmforge ({'path': 'runs/smoke', 'batch_size': '16', 'device': 'cpu'})"
    assert any(line.startswith(header) for line in done.stdout.splitlines()), done.stdout
    (results,) = (tmp_path / "results").rglob("results_*.json")
    record = json.loads(results.read_text())
    assert (record["config"]["device"], record["config"]["batch_size"]) == ("cpu", "16")
    limit = int(argv[argv.index("--limit") + 1])
    loaded = load_checkpoint(checkpoint)
    task = load_task(SHIPPED_DIR / "stdlib_next_line.yaml")
    runner = TaskRunner(
        [task],
        loaded.tokenizer.encode,
        eod=loaded.tokenizer.eod,
        seq_len=loaded.cfg.seq_len,
        batch_size=16,
        limit=limit,
    )
    ours, _ = runner.run_fn(loaded.token_logprobs, torch.device("cpu"))
    assert record["results"]["stdlib_next_line"]["acc,none"] == ours["eval/stdlib_next_line/acc"]
