"""Case builders shared by the parity harness's reference fixture (conftest.py) and test_parallel_parity.py."""
from __future__ import annotations

from collections import Counter
from typing import List


def stand_in_eod(samples) -> int:
    """The document end of the data.document_masking cases: the parity samples are one continuous text (no EOD),
    so their most frequent token stands in for it and every sample holds several documents."""
    return Counter(t for sample in samples for t in sample).most_common(1)[0][0]


def docmask_case(overrides: List[str], samples) -> dict:
    return {"overrides": overrides + ["data.document_masking=true"], "eod": stand_in_eod(samples)}
