"""Fixtures of the multi-rank parallel tests."""
from __future__ import annotations

from typing import List

import pytest

N_SAMPLES = 48  # 5 steps x global batch 8, plus held-out rows for the eval loss
SAMPLE_TOKENS = 33  # seq_len 32 + 1 (inputs and shifted targets)


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
    return [ids[i * SAMPLE_TOKENS:(i + 1) * SAMPLE_TOKENS] for i in range(N_SAMPLES)]
