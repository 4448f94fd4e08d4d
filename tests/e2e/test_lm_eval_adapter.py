"""lm-evaluation-harness's own offline run of a local task with ``--model lmforge``: the same accuracies and
per-choice log-likelihoods as lmforge's in-loop scorer on the checkpoint; rolling log-likelihood and
generate_until against direct computations."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
import yaml

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


def local_task(tmp_path) -> str:
    """The shipped stdlib_next_line task as an lm-eval task directory (absolute data path: lm-eval reads it
    relative to the working directory)."""
    from lmforge.evaluation.tasks import SHIPPED_DIR

    spec = yaml.safe_load((SHIPPED_DIR / "stdlib_next_line.yaml").read_text())
    spec["task"] = "stdlib_local"
    spec["dataset_kwargs"]["data_files"] = {"test": str(SHIPPED_DIR / "stdlib_next_line.jsonl")}
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "stdlib_local.yaml").write_text(yaml.safe_dump(spec))
    return str(tmp_path / "tasks" / "stdlib_local.yaml")


@pytest.mark.timeout(600)
def test_lm_eval_simple_evaluate_agrees_with_the_in_loop_scorer(checkpoint, tmp_path, monkeypatch):
    for key, value in {"HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(key, value)
    import lm_eval
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    import lmforge.interop.lm_eval_model  # noqa: F401 - registers the model "lmforge"
    from lmforge.evaluation.offline import load_checkpoint, untrained_like
    from lmforge.evaluation.runner import TaskRunner
    from lmforge.evaluation.tasks import load_task
    from lmforge.generation.decode import generate

    path = local_task(tmp_path)
    out = lm_eval.simple_evaluate(
        model="lmforge",
        model_args=f"path={checkpoint},batch_size=8",
        tasks=["stdlib_local"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        limit=LIMIT,
        log_samples=True,
    )
    theirs = out["results"]["stdlib_local"]
    samples = sorted(out["samples"]["stdlib_local"], key=lambda s: s["doc_id"])

    loaded = load_checkpoint(checkpoint)
    task = load_task(path)
    runner = TaskRunner(
        [task], loaded.tokenizer.encode, eod=loaded.tokenizer.eod, seq_len=loaded.cfg.seq_len, batch_size=8, limit=LIMIT
    )
    ours, records = runner.run_fn(loaded.token_logprobs, torch.device("cpu"))
    assert theirs["acc,none"] == ours["eval/stdlib_local/acc"]
    assert theirs["acc_norm,none"] == ours["eval/stdlib_local/acc_norm"]
    assert [s["doc_id"] for s in samples] == list(range(LIMIT))
    for s, rec in zip(samples, records["stdlib_local"]):
        assert [r[0][0] for r in s["resps"]] == pytest.approx(rec["lls"], abs=1e-4)
    assert len({round(x, 3) for rec in records["stdlib_local"] for x in rec["lls"]}) > LIMIT  # not all equal
    # negative control: other weights of the same shape do not reproduce lm-eval's log-likelihoods
    _, other = runner.run_fn(untrained_like(loaded, seed=9).token_logprobs, torch.device("cpu"))
    assert [r[0][0] for r in samples[0]["resps"]] != pytest.approx(other["stdlib_local"][0]["lls"], abs=1e-2)

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
