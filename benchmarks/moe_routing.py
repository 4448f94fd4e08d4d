"""Routing in the first steps of an MoE run on real text: per-layer load max/mean and how much of the router
inputs is one shared direction (docs/model.md, routing collapse). A measurement, not a speed benchmark.

    python -m benchmarks.moe_routing --shard CACHE/shards/embedded-books-v2-XXXX.bin [--steps 24]
        [--d-model 128] [--moe '{"aux_loss_coef": 0.1}'] [--untied] [--jitter 0.01] [--router-lr-mult 0.1]
        [--warmup 30] [--center]

``--jitter eps`` multiplies each router input element by U(1 - eps, 1 + eps) in training (Switch Transformer's
input jitter, applied by a forward pre-hook on the routers); ``--router-lr-mult`` scales the router gates'
learning rate; ``--warmup`` the linear warm-up steps; ``--center`` subtracts the batch mean from the router
inputs (a test of the diagnosis: routing then depends on the batch, so it is no fix as it stands). The candidate
fixes measured with these flags: benchmarks/reports/2026-12-moe.md.

The model is moe_smoke's routing (8 experts, top-2, expert width 1.5 x d_model, aux 0.01, z 0.001) on a
4-layer GPT of ``--d-model``; the optimizer is the preset's (AdamW lr 3e-3, betas 0.9/0.95, weight decay 0.1 on
matrices, 30 warm-up steps, clipping at 1.0); batches are 8 random windows of 64 tokens of the shard
(a megatron ``.bin`` of uint16 token ids). ``shared`` is |mean over tokens of x| / mean |x| for each MoE
layer's router input x: 1.0 means every token gives the router the same input.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
import torch.nn.functional as F

from lmforge.config.model import ModelConfig, MoEConfig
from lmforge.model.gpt import GPT
from lmforge.model.moe import MoECollector, MoEFeedForward
from lmforge.optim.adamw import param_groups


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shard", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--moe", default="{}", help="JSON overrides of model.moe")
    ap.add_argument("--untied", action="store_true")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--jitter", type=float, default=0.0)
    ap.add_argument("--router-lr-mult", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--center", action="store_true", help="subtract the batch mean from the router inputs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    d = args.d_model
    moe = dict(experts=8, top_k=2, d_ff=(384 * d) // 256, aux_loss_coef=0.01, z_loss_coef=0.001)
    moe.update(json.loads(args.moe))
    cfg = ModelConfig(
        name="routing",
        vocab_size=8192,
        d_model=d,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        seq_len=64,
        tie_embeddings=not args.untied,
        moe=MoEConfig(**moe),
    )
    model = GPT(cfg)
    model.init_weights(0)
    collector = MoECollector(model, cfg.moe)
    groups = param_groups([(n, p) for n, p in model.named_parameters() if ".router." not in n], 0.1)
    routers = [p for n, p in model.named_parameters() if ".router." in n]
    groups.append({"params": routers, "weight_decay": 0.1, "lr_mult": args.router_lr_mult})
    opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95))
    if args.center:  # a diagnosis of the cause, not a fix: it makes routing depend on the batch
        for m in model.modules():
            if type(m).__name__ == "Router":
                m.register_forward_pre_hook(lambda _m, inputs: (inputs[0] - inputs[0].mean(0, keepdim=True),))
    if args.jitter > 0:

        def jitter(_module, inputs):
            x = inputs[0]
            return (x * torch.empty_like(x).uniform_(1 - args.jitter, 1 + args.jitter),)

        for m in model.modules():
            if type(m).__name__ == "Router":
                m.register_forward_pre_hook(jitter)
    data = np.memmap(args.shard, dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)
    shared = {}
    loads = []  # per step, per layer: load max/mean

    def record(name):
        def hook(_module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            shared[name] = (x.mean(0).norm() / x.norm(dim=-1).mean()).item()

        return hook

    for name, m in model.named_modules():
        if isinstance(m, MoEFeedForward):
            m.register_forward_pre_hook(record(name))
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = max(3e-3 * min(1.0, step / args.warmup), 1e-4) * g.get("lr_mult", 1.0)
        starts = rng.integers(0, len(data) - cfg.seq_len - 1, 8)
        seq = torch.from_numpy(np.stack([data[s : s + cfg.seq_len + 1].astype(np.int64) for s in starts]))
        logits = model(seq[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        (ce + collector.router_loss()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if cfg.moe.bias_update_rate > 0:
            collector.update_bias(collector.loads)
        metrics = collector.step_metrics()
        loads.append([float(metrics[f"moe/layer{i}/load_max_over_mean"]) for i in range(cfg.n_layers)])
        if step == 1 or step % args.every == 0:
            load = " ".join(f"{float(metrics[f'moe/layer{i}/load_max_over_mean']):.2f}" for i in range(cfg.n_layers))
            print(
                f"step {step:3d}  ce {ce.item():.3f}  load max/mean {load}  shared "
                + " ".join(f"{v:.2f}" for v in shared.values()),
                flush=True,
            )

    per_step = np.array(loads)
    print(
        f"summary over steps 1-{args.steps}: load max/mean mean {per_step.mean():.2f} (layers "
        + " ".join(f"{v:.2f}" for v in per_step.mean(0))
        + f"), worst layer mean {per_step.max(1).mean():.2f}, "
        f"final ce {ce.item():.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
