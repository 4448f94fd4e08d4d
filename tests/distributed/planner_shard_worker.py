"""Rank body for tests/distributed/test_planner_shards.py: build the real engine, train one step, and
report the bytes of this rank's local shards of parameters, gradients and AdamW state."""

from __future__ import annotations

from typing import List


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def measure(overrides: List[str]) -> dict:
    import torch

    from lmforge.comm.process_group import init_process_group
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate
    from lmforge.parallel.native_engine import NativeEngine

    torch.set_num_threads(1)
    cfg = validate(compose(overrides))
    device = torch.device("cpu")
    world = init_process_group(cfg.comm, device)
    torch.manual_seed(world.rank)
    engine = NativeEngine(cfg, device)
    b, t = cfg.train.micro_batch_size, cfg.model.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, t))
    targets = torch.randint(0, cfg.model.vocab_size, (b, t))
    engine.forward_loss(tokens, targets).backward()
    params = list(engine.inner.parameters())
    grads = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
    engine.optimizer.step()
    state = engine.optimizer.state
    optimizer = sum(_local_bytes(v) for p in params for v in state[p].values() if isinstance(v, torch.Tensor))
    return {
        "rank": world.rank,
        "coords": {dim: engine.mesh[dim].get_local_rank() for dim in ("pp", "tp", "dp_shard")},
        "params": sum(_local_bytes(p) for p in params),
        "grads": grads,
        "optimizer": optimizer,
        "tensors": len(params),
        "dtensor": all(hasattr(p, "to_local") for p in params),
        "local_shapes": {
            n: list((p.to_local() if hasattr(p, "to_local") else p).shape) for n, p in engine.inner.named_parameters()
        },
    }
