"""The µP coordinate check (Yang et al. 2022, "Tensor Programs V", Section 7 / Figure 5) on lmforge's GPT: widths 64
to 1024 (4 heads, d_ff = 4 d, 2 layers), 3 seeds, 5 Adam steps on one batch of 4 x 16 random tokens at lr 2e-3 with
model.mup_base_width=64. For each layer type (embedding output, attention block output, MLP block output, logits)
the mean |x| after the steps and the mean |x_5 - x_0| (the update) are averaged over seeds and fitted against width
in log-log: under µP every slope is within 0.1 of 0; under the standard parametrization (the negative control)
the logits grow, slope >= 0.5 (the attention and MLP outputs grow faster still).

In the full tier: about 15 CPU-seconds (the width-1024 models dominate)."""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import pytest
import torch

from lmforge.config.model import ModelConfig
from lmforge.config.optim import OptimConfig
from lmforge.model.gpt import GPT, cross_entropy_loss
from lmforge.optim.adamw import build_optimizer, set_learning_rate

WIDTHS = (64, 128, 256, 512, 1024)
SEEDS = (0, 1, 2)
STEPS, LR, BASE = 5, 2e-3, 64
LAYERS = ("embedding", "attention", "mlp", "logits")


def probes(model: GPT) -> Tuple[Dict[str, torch.Tensor], list]:
    """Forward hooks recording each layer type's output (the last block's attention and MLP)."""
    seen: Dict[str, torch.Tensor] = {}
    last = model.layers[str(model.cfg.n_layers - 1)]
    modules = zip(LAYERS, (model.tok_embeddings, last.attention, last.feed_forward, model.output))
    hooks = [m.register_forward_hook(lambda _m, _i, out, k=k: seen.__setitem__(k, out.detach())) for k, m in modules]
    return seen, hooks


def sizes(parametrization: str, width: int, seed: int) -> Dict[str, Tuple[float, float]]:
    """layer -> (mean |x| after STEPS Adam steps, mean |x_STEPS - x_0|) on the training batch."""
    cfg = ModelConfig(
        vocab_size=256,
        d_model=width,
        n_layers=2,
        n_heads=4,
        d_ff=4 * width,
        seq_len=16,
        tie_embeddings=False,
        parametrization=parametrization,
        mup_base_width=BASE,
    )
    model = GPT(cfg)
    model.init_weights(seed)
    opt = build_optimizer(model, OptimConfig(lr=LR, weight_decay=0.0), torch.device("cpu"), cfg)
    set_learning_rate(opt, LR)
    batch = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    seen, _ = probes(model)
    with torch.no_grad():
        model(inputs)
    before = dict(seen)
    for _ in range(STEPS):
        cross_entropy_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        model(inputs)
    return {k: (seen[k].abs().mean().item(), (seen[k] - before[k]).abs().mean().item()) for k in LAYERS}


def slope(widths, values) -> float:
    """Least-squares slope of log(value) against log(width)."""
    xs, ys = [math.log(w) for w in widths], [math.log(v) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def coordinate_slopes(parametrization: str) -> Dict[str, Tuple[float, float]]:
    """layer -> (activation slope, update slope) over WIDTHS, each width's sizes averaged over SEEDS."""
    torch.set_num_threads(1)
    per_width: Dict[str, List[Tuple[float, float]]] = {k: [] for k in LAYERS}
    for width in WIDTHS:
        runs = [sizes(parametrization, width, seed) for seed in SEEDS]
        for k in LAYERS:
            per_width[k].append(tuple(sum(r[k][i] for r in runs) / len(runs) for i in (0, 1)))
    return {k: (slope(WIDTHS, [a for a, _ in v]), slope(WIDTHS, [u for _, u in v])) for k, v in per_width.items()}


@pytest.mark.timeout(300)
def test_mup_coordinates_are_width_independent_and_sp_logits_grow():
    mup = coordinate_slopes("mup")
    off = {k: s for k, s in mup.items() if max(abs(s[0]), abs(s[1])) > 0.1}
    assert not off, f"µP slopes (activation, update) not within 0.1 of 0: {off} (all: {mup})"
    sp = coordinate_slopes("sp")
    assert sp["logits"][0] >= 0.5 and sp["logits"][1] >= 0.5, f"SP logits should blow up with width: {sp}"
    assert sp["mlp"][0] >= 0.5 and sp["attention"][0] >= 0.5, sp
