"""The replica fingerprint is exact (any single flipped bit changes it; a float sum misses a low bit) and the
majority rule names the minority replica, or every replica when there is no majority."""

from __future__ import annotations

import torch

from lmforge.fault.consistency import Mismatch, bit_fingerprint, disagreeing
from lmforge.fault.drills import flip_bit


def test_every_single_bit_flip_changes_the_fingerprint_of_fp32_and_bf16():
    for dtype in (torch.float32, torch.bfloat16):
        base = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
        ref = int(bit_fingerprint(base))
        for bit in range(8 * base.element_size()):
            t = base.clone()
            assert flip_bit([("w", t)], "w", bit) == "w"
            assert int(bit_fingerprint(t)) != ref, (dtype, bit)
            assert int(bit_fingerprint(base.clone())) == ref  # deterministic
    # Negative control: a float sum does not see a lowest-mantissa flip on a large tensor.
    base = torch.full((4096,), 1000.0)
    t = base.clone()
    flip_bit([("w", t)], "w", 0)
    assert not torch.equal(t, base) and float(t.sum()) == float(base.sum())
    assert int(bit_fingerprint(t)) != int(bit_fingerprint(base))


def test_majority_names_the_minority_and_no_majority_names_all():
    assert disagreeing([[1, 2, 3], [1, 2, 3], [1, 2, 3]]) == ([], [])
    assert disagreeing([[1, 2, 3], [1, 9, 3], [1, 2, 3]]) == ([1], [1])
    assert disagreeing([[1, 2, 3], [1, 9, 3]]) == ([0, 1], [1])
    assert disagreeing([[1, 2, 3], [1, 9, 3], [1, 2, 7], [1, 2, 3]]) == ([1, 2], [1, 2])
    m = Mismatch(8, [5], [1, 5, 9], ["a.weight"])
    assert m.describe() == (
        "replicas [1, 5, 9] of the same shard: rank(s) 5 differ from the other replicas (1, 9) on 1 tensor(s): a.weight"
    )
