"""What rank i of a replica group sends to rank i of a healing peer group (``fault.replica_ft=torchft``): its local
shards of the model and optimizer state, as plain tensors, and how the receiver copies them into its own.

torchft's HTTP transport pickles what it is given; a DTensor (FSDP2's and TP's parameters, sharded or replicated, and
their AdamW moments) would carry the sender's DeviceMesh, which the receiving process cannot use as it is. Both groups
have the same layout, so rank i's local shards are the same shapes on both: the sender sends ``to_local()`` of every
tensor, and the receiver copies each into its own tensor of the same name (parameters and buffers in place), or, for
optimizer state it does not have yet (a fresh process), wraps it as a DTensor on its own parameter's mesh and
placements before ``Optimizer.load_state_dict``.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.fault.consistency import local_tensor

Shards = Dict[str, object]


def model_shards(model: nn.Module) -> Dict[str, torch.Tensor]:
    """This rank's part of every entry of ``model.state_dict()`` (views of the live tensors, not copies)."""
    return {name: local_tensor(t) for name, t in model.state_dict().items()}


@torch.no_grad()
def load_model_shards(model: nn.Module, shards: Dict[str, torch.Tensor]) -> None:
    """Copy a peer rank's ``model_shards`` into this rank's parameters and buffers, in place."""
    own = model.state_dict()
    if set(own) != set(shards):
        missing, extra = sorted(set(own) - set(shards)), sorted(set(shards) - set(own))
        raise RuntimeError(f"the peer's model state differs from this one's: missing {missing}, unexpected {extra}")
    for name, tensor in own.items():
        local_tensor(tensor).copy_(shards[name])


def optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Shards]:
    """Every parameter's optimizer state by parameter name, tensors as this rank's local shards."""
    out: Dict[str, Shards] = {}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param)
        if state:
            out[name] = {k: local_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    return out


def _on_layout_of(param: torch.Tensor, value: object) -> object:
    """A received state value as this rank's optimizer holds it: a DTensor on ``param``'s mesh where ``param`` is
    one and the value is parameter-shaped (AdamW's moments), else as received (a scalar step count)."""
    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() == param.dim():
        local = value.to(param.to_local().device)
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value


def load_optimizer_shards(model: nn.Module, optimizer: torch.optim.Optimizer, shards: Dict[str, Shards]) -> None:
    """A peer rank's ``optimizer_shards`` loaded through ``Optimizer.load_state_dict`` (its dtype and device rules),
    with this optimizer's own hyperparameters."""
    own = optimizer.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in own["param_groups"] for i in group["params"]]
    unknown = sorted(set(shards) - set(names.values()))
    if unknown:
        raise RuntimeError(f"the peer's optimizer state names parameters this model lacks: {unknown}")
    state = {}
    for index, param in zip(indices, params):
        sent = shards.get(names[id(param)])
        if sent:
            state[index] = {k: _on_layout_of(param, v) for k, v in sent.items()}
    optimizer.load_state_dict({"state": state, "param_groups": own["param_groups"]})
