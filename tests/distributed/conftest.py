"""Fixtures of the multi-rank parallel tests."""

from __future__ import annotations

from typing import List

import pytest

N_SAMPLES = 48  # 3 steps x global batch 8 (and the resumed steps after them), plus held-out rows for the eval loss
SAMPLE_TOKENS = 33  # seq_len 32 + 1 (inputs and shifted targets)
# Optimizer steps of every parity case (test_parallel_parity.STEPS): step 1 is the initial weights' forward and
# backward, steps 2-3 run on clipped updates and AdamW moments (the suite ran 5: 3 exercise the same, in less time).
PARITY_STEPS = 3


@pytest.fixture(scope="session")
def parity_samples(data_cache) -> List[List[int]]:
    """Fixed training samples of real text: the first Austen chapters, embedded tokenizer, 33-token windows."""
    from lmforge.data.embedded import iter_documents
    from lmforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer("embedded", data_cache)
    ids: List[int] = []
    for doc in iter_documents("books"):
        ids.extend(tok.encode(doc))
        if len(ids) >= N_SAMPLES * SAMPLE_TOKENS:
            break
    return [ids[i * SAMPLE_TOKENS : (i + 1) * SAMPLE_TOKENS] for i in range(N_SAMPLES)]


@pytest.fixture(scope="session")
def references(parity_samples) -> dict:
    """Single-process runs of the parity harness (test_parallel_parity.py, test_context_parallel.py): untied
    embeddings (tiny's default), tied embeddings, document-masked, a small MoE, fp8 (tensorwise and rowwise),
    µP and a µP MoE, PARITY_STEPS each."""
    from distributed.parity_cases import FP8, MOE, MUP, docmask_case
    from harness import run_ranks

    cases = {
        "untied": {"overrides": []},
        "tied": {"overrides": ["model.tie_embeddings=true"]},
        "docmask": docmask_case([], parity_samples),
        # eval loss of the initial weights, computed in bf16 (the reference for FSDP param_dtype=bf16)
        "bf16_init": {"overrides": ["train.precision=bf16"], "steps": 0},
        "fp32_init": {"overrides": [], "steps": 0},
        "moe": {"overrides": MOE},
        "fp8": {"overrides": FP8},
        "fp8_rowwise": {"overrides": FP8 + ["train.fp8.recipe=rowwise"]},
        "mup": {"overrides": MUP},
        "moe_mup": {"overrides": MOE + MUP},
    }
    args = {"cases": cases, "samples": parity_samples, "steps": PARITY_STEPS}
    return run_ranks("distributed.parallel_worker:run_cases", 1, args, timeout=200)[0].value


@pytest.fixture(scope="session")
def reference(references) -> dict:
    return references["untied"]
