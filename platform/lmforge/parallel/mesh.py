"""The DeviceMesh, built from the parallelism config with named dims.

Dims, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp`` (as torchtitan orders them). Every
dim exists, size 1 when unused, so code can always ask ``mesh["tp"]``.
Flattened dims: ``dp`` (dp_replicate x dp_shard: data loading is sharded by this rank only, so the cp ranks of
a group read the same samples) and, when cp > 1, ``dp_shard_cp`` (what FSDP shards over when cp > 1: cp ranks hold weight
replicas, so their gradients are reduced with the data-parallel ones) and ``dp_cp`` (every rank holding a
part of the global batch: losses are averaged over it).

Expert parallelism (ep > 1) is borrowed from ``dp_shard``: that dim is built as ``dp_shard_mod_ep`` x ``ep``
(ep innermost: an ep group is ep consecutive dp_shard ranks) and ``dp_shard`` is their flattening, so every
dense-part use of ``mesh["dp_shard"]`` and every data-parallel rank is exactly what it is without ep. The
experts of a rank are split over ``ep`` and FSDP-sharded over ``dp_shard_mod_ep`` (replicated over
``dp_replicate``): the ranks holding the same experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lmforge.config.parallelism import ParallelismConfig

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_DIM_NAMES = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")  # the built dims when ep > 1


@dataclass
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 1
    ep: int = 1  # a split of dp_shard, not a factor of the world size

    @classmethod
    def from_config(cls, cfg: ParallelismConfig) -> "ParallelDims":
        return cls(cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.tp, cfg.cp, cfg.ep)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)


def build_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh:
    if dims.ep > 1:
        mesh = init_device_mesh(device.type, (dims.pp, dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep, dims.cp,
                                              dims.tp), mesh_dim_names=EP_DIM_NAMES)
        mesh[("dp_shard_mod_ep", "ep")]._flatten(mesh_dim_name="dp_shard")
        mesh[("dp_replicate", "dp_shard_mod_ep", "ep")]._flatten(mesh_dim_name="dp")
        return mesh  # (cp > 1 with ep > 1 is refused by config/moe_checks.py)
    mesh = init_device_mesh(device.type, dims.shape, mesh_dim_names=DIM_NAMES)
    # A flattened data-parallel dim for loss averaging and FSDP over (replicate x shard) when needed.
    mesh[("dp_replicate", "dp_shard")]._flatten(mesh_dim_name="dp")
    if dims.cp > 1:  # (only then: each flattened dim is a new process group)
        mesh[("dp_shard", "cp")]._flatten(mesh_dim_name="dp_shard_cp")
        mesh[("dp_replicate", "dp_shard", "cp")]._flatten(mesh_dim_name="dp_cp")
    return mesh


def dp_rank(mesh: DeviceMesh) -> int:
    return mesh["dp"].get_local_rank()


def describe(mesh: DeviceMesh) -> dict:
    return {name: mesh[name].size() for name in DIM_NAMES}
