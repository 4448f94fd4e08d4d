"""GPT-2's tanh-approximate GELU, the ``mlp: gelu`` activation of the dense and the expert FFNs.

Eager, it is torch's own kernel (``F.gelu(x, approximate="tanh")``). Inside a ``torch.compile`` graph it is written
out through the identity ``0.5 * (1 + tanh(u)) = sigmoid(2u)``, ``u = sqrt(2/pi) * (x + 0.044715 x^3)``: the same
function (values differ by float rounding only, ~1e-7 relative), which inductor fuses, forward and backward,
into one pass each with an ``exp`` where the decomposed GELU needs a ``tanh``. On the 2-vCPU benchmark machine
(AVX2, fp32) the compiled FFN forward + backward at bench_small took 0.92x the time of the compiled
``F.gelu`` (benchmarks/reports/2026-12-step-speed.md); on GPU it is unmeasured (a fused elementwise pass either way).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_TWO_SQRT_2_OVER_PI = 2.0 * math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return x * torch.sigmoid(_TWO_SQRT_2_OVER_PI * (x + 0.044715 * (x * x * x)))
    return F.gelu(x, approximate="tanh")
