"""In-loop evaluation on the training mesh: 2 gloo ranks under DDP, FSDP, TP and PP (one launch) score a shipped
task with the same per-choice log-likelihoods and accuracies as one process scoring the same model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from harness import run_ranks

pytestmark = pytest.mark.distributed

TASK, LIMIT = "stdlib_next_line", 6
LAYOUTS = {
    "ddp": ["parallelism=ddp"],
    "fsdp": ["parallelism=fsdp"],
    "tp2": ["parallelism=tp2"],
    "pp2": ["parallelism=pp2"],
}


def single_process(seed=None):
    from distributed.parallel_worker import BASE

    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.evaluation.offline import LoadedModel
    from lmforge.evaluation.runner import TaskRunner
    from lmforge.evaluation.tasks import load_task
    from lmforge.model.gpt import GPT

    cfg = validate(compose(BASE), world_size=1)
    model = GPT(cfg.model)
    model.init_weights(
        cfg.train.seed if seed is None else seed
    )  # what parallelize's materialize() does with train.seed on every layout
    tok = load_tokenizer("embedded", Path(os.environ["LMFORGE_DATA_CACHE"]))
    loaded = LoadedModel(model.eval(), cfg.model, tok, None)
    task = load_task(TASK)
    runner = TaskRunner([task], tok.encode, eod=tok.eod, seq_len=cfg.model.seq_len, batch_size=4, limit=LIMIT)
    metrics, records = runner.run_fn(loaded.token_logprobs, torch.device("cpu"))
    return cfg, metrics, [r["lls"] for r in records[task.name]]


@pytest.mark.timeout(600)
def test_task_scores_match_single_process_on_every_layout(data_cache):
    results = run_ranks(
        "distributed.eval_ranks:eval_layouts",
        2,
        {"layouts": LAYOUTS, "task": TASK, "limit": LIMIT},
        timeout=540,
        env={"LMFORGE_DATA_CACHE": str(data_cache)},
    )
    cfg, metrics, lls = single_process(seed=None)
    assert len(lls) == LIMIT and all(len(x) == 4 for x in lls)
    for name in LAYOUTS:
        for rank in results:
            got = rank.value[name]
            assert got["metrics"] == pytest.approx(metrics, abs=1e-4), (name, rank.rank)
            for a, b in zip(got["lls"], lls):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-4), (name, rank.rank)
            # the accuracies are exactly the single process's (every rank holds every score)
            assert got["metrics"][f"eval/{TASK}/acc"] == metrics[f"eval/{TASK}/acc"]
    # negative control: a model initialised differently scores differently
    _, _, other = single_process(seed=4321)
    assert max(abs(a - b) for x, y in zip(other, lls) for a, b in zip(x, y)) > 1e-2
