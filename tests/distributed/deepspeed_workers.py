"""Rank functions for tests/distributed/test_deepspeed.py (started by harness.run_ranks).

Every case trains the tiny GPT for STEPS optimizer steps of one global batch of GLOBAL real-text sequences
(the embedded Austen novels through the embedded BPE tokenizer). Micro batch j of data-parallel rank r
takes sequences j*m*dp + r*m + [0, m), the platform's sampler rule, so every layout sees the same samples.
"""

from __future__ import annotations

import os
from typing import Dict, List

import torch

STEPS = 5
GLOBAL = 8
BASE = [
    "model=tiny",
    "train.device=cpu",
    "train.threads=1",
    f"train.global_batch_size={GLOBAL}",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "optim.grad_clip=0.5",
]


class MicroBatch:
    def __init__(self, tokens: torch.Tensor):
        self.tokens, self.targets, self.source_ids = tokens[:, :-1], tokens[:, 1:], []
        self.positions = None  # no document masking (lmforge.data.loader.MicroBatch)


def real_text_batches(cache: str, seq_len: int) -> torch.Tensor:
    """[STEPS, GLOBAL, seq_len + 1] token ids from the first Austen novel."""
    from pathlib import Path

    from lmforge.data.embedded import iter_documents
    from lmforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer("embedded", Path(cache))
    ids: List[int] = []
    need = STEPS * GLOBAL * (seq_len + 1)
    for doc in iter_documents("books"):
        ids += tok.encode(doc)
        if len(ids) >= need:
            break
    return torch.tensor(ids[:need], dtype=torch.long).view(STEPS, GLOBAL, seq_len + 1)


def micro_batches(step_tokens: torch.Tensor, micro: int, dp: int, rank: int) -> List[MicroBatch]:
    accum = GLOBAL // (micro * dp)
    return [
        MicroBatch(step_tokens[j * micro * dp + rank * micro : j * micro * dp + rank * micro + micro])
        for j in range(accum)
    ]


def lr_at(step: int, cfg) -> float:
    from lmforge.optim.schedule import lr_multiplier

    return cfg.optim.lr * lr_multiplier(step, cfg.optim, cfg.train.max_steps)


def train(engine, cfg, data: torch.Tensor, micro: int, dp: int, rank: int) -> Dict[str, list]:
    losses, norms = [], []
    for step in range(STEPS):
        res = engine.train_step(micro_batches(data[step], micro, dp, rank), lr_at(step, cfg))
        losses.append(float(res.loss))
        norms.append(float(res.grad_norm))
    return {"losses": losses, "grad_norms": norms}


def task_lls(engine, cache: str, seq_len: int) -> list:
    """Per-choice log-likelihoods of 4 documents of a shipped task through ``Engine.token_logprobs``."""
    from pathlib import Path

    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.evaluation.runner import TaskRunner
    from lmforge.evaluation.tasks import load_task

    tok = load_tokenizer("embedded", Path(cache))
    engine.eval()
    runner = TaskRunner(
        [load_task("stdlib_next_line")], tok.encode, eod=tok.eod, seq_len=seq_len, batch_size=4, limit=4
    )
    _, records = runner.run(engine)
    engine.train()
    return [r["lls"] for r in records["stdlib_next_line"]]


def native_reference(cache: str, precision: str = "fp32") -> dict:
    """The single-process native engine on the same data: one micro batch of the whole global batch."""
    from lmforge.comm.process_group import init_process_group
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.parallel.build_engine import build_engine

    device = torch.device("cpu")
    torch.set_num_threads(1)
    out = {}
    for prec in ("fp32", "bf16-mixed"):
        cfg = validate(
            compose(BASE + [f"train.micro_batch_size={GLOBAL}", f"train.precision={prec}", f"train.max_steps={STEPS}"]),
            world_size=1,
        )
        init_process_group(cfg.comm, device)
        engine = build_engine(cfg, device)
        out[prec] = train(engine, cfg, real_text_batches(cache, cfg.model.seq_len), GLOBAL, 1, 0)
        if prec == "fp32":
            out[prec]["task_lls"] = task_lls(engine, cache, cfg.model.seq_len)
    return out


CASES = {  # name: (overrides, micro batch size)
    "zero1": (["parallelism=zero1"], 4),
    "zero2": (["parallelism=zero2"], 4),
    "zero3": (["parallelism=zero3"], 4),
    "zero3_offload": (["parallelism=zero3_offload"], 4),
    "zero2_accum2": (["parallelism=zero2"], 2),
    "zero3_bf16": (["parallelism=zero3", "train.precision=bf16-mixed"], 4),
}


def deepspeed_cases(cache: str, names: List[str]) -> dict:
    """Each named case on 2 gloo ranks: per-step losses/grad norms, the engine's footprint and its DS config."""
    from lmforge.comm.process_group import init_process_group
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.parallel.build_engine import build_engine

    device = torch.device("cpu")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {}
    data = None
    for name in names:
        overrides, micro = CASES[name]
        over = BASE + overrides + [f"train.micro_batch_size={micro}", f"train.max_steps={STEPS}"]
        if not any(o.startswith("train.precision") for o in over):
            over.append("train.precision=fp32")
        cfg = validate(compose(over), world_size=2)
        init_process_group(cfg.comm, device)
        if data is None:
            data = real_text_batches(cache, cfg.model.seq_len)
        engine = build_engine(cfg, device)
        result = train(engine, cfg, data, micro, 2, rank)
        if name == "zero3":  # downstream evaluation through ZeRO-3's partitioned parameters
            result["task_lls"] = task_lls(engine, cache, cfg.model.seq_len)
        result["footprint"] = engine.footprint()
        result["ds_config"] = engine.ds_config
        result["engine"] = type(engine).__name__
        result["param_dtype"] = str(next(engine.inner.parameters()).dtype)
        engine.close()
        results[name] = result
    return results
