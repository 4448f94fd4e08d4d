"""What a replica group's rank sends a healing peer's rank (lmforge.fault.heal_shards): local shards as plain tensors,
through the codec of torchft's HTTP transport, into a fresh process's FSDP2 or tensor-parallel model (column- and
row-sharded weights, a replicated bias) and an optimizer without state."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torchft.checkpointing._serialization import _streaming_load, _streaming_save

from lmforge.fault.consistency import local_tensor
from lmforge.fault.heal_shards import load_model_shards, load_optimizer_shards, model_shards, optimizer_shards


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo group for the module (another test's group is used as it is)."""
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if mine:
        dist.destroy_process_group()


def _replica(seed: int, layout: str):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    if layout == "fsdp2":
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    elif layout in ("tp", "tp_fsdp2"):  # weights Shard(0) and Shard(1), the row-parallel bias Replicate
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        if layout == "tp_fsdp2":  # and each of them sharded over dp_shard too (a 2-D mesh, as parallelism=tp2_dp2)
            fully_shard(model, mesh=mesh["dp_shard"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model, optimizer, seed: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _over_the_wire(payload):
    """torchft's HTTP transport codec (what a peer's rank receives)."""
    buf = io.BytesIO()
    _streaming_save(payload, buf)
    buf.seek(0)
    return _streaming_load(buf, weights_only=False)


def _locals(model, optimizer):
    out = [local_tensor(p).clone() for p in model.parameters()]
    return out + [local_tensor(v).clone() for p in model.parameters() for v in optimizer.state[p].values()]


@pytest.mark.parametrize("layout", ["fsdp2", "tp", "tp_fsdp2", "plain"])
def test_a_fresh_replica_takes_a_peers_shards_and_steps_identically(world, layout):
    peer, peer_opt = _replica(0, layout)
    for seed in (1, 2):
        _step(peer, peer_opt, seed)
    fresh, fresh_opt = _replica(7, layout)  # another initialisation, no optimizer state yet
    assert not fresh_opt.state
    before = [local_tensor(p).clone() for p in fresh.parameters()]

    sent = _over_the_wire({"model": model_shards(peer), "optimizer": optimizer_shards(peer, peer_opt)})
    leaves = list(sent["model"].values()) + [v for s in sent["optimizer"].values() for v in s.values()]
    assert leaves and not any(isinstance(v, DTensor) for v in leaves)  # no DeviceMesh travels
    load_model_shards(fresh, sent["model"])
    load_optimizer_shards(fresh, fresh_opt, sent["optimizer"])

    assert all(torch.equal(a, b) for a, b in zip(_locals(fresh, fresh_opt), _locals(peer, peer_opt)))
    moments = [fresh_opt.state[p]["exp_avg"] for p in fresh.parameters()]
    assert all(isinstance(m, DTensor) == (layout != "plain") for m in moments)  # on the receiver's own layout
    if layout != "plain":
        assert [m.placements for m in moments] == [p.placements for p in fresh.parameters()]
    _step(peer, peer_opt, 3)
    _step(fresh, fresh_opt, 3)
    assert all(torch.equal(a, b) for a, b in zip(_locals(fresh, fresh_opt), _locals(peer, peer_opt)))
    # negative control: the fresh replica's own initialisation was not its peer's
    assert not all(torch.equal(a, local_tensor(p)) for a, p in zip(before, peer.parameters()))


def test_a_peer_state_of_another_model_is_refused_by_name(world):
    peer, _ = _replica(0, "plain")
    other = nn.Sequential(nn.Linear(4, 8))
    with pytest.raises(RuntimeError, match=r"missing \[\], unexpected \['1.bias', '1.weight'\]"):
        load_model_shards(other, model_shards(peer))
