"""The DeviceMesh, built from the parallelism config with named dims.

Dims, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp`` (room is left for ``cp`` and ``ep``
between dp_shard and tp, as torchtitan orders them). Every dim exists, size 1 when unused, so code can
always ask ``mesh["tp"]``. Data loading is sharded by the flattened data-parallel rank only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lmforge.config.parallelism import ParallelismConfig

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def from_config(cls, cfg: ParallelismConfig) -> "ParallelDims":
        return cls(cfg.pp, cfg.dp_replicate, cfg.dp_shard, cfg.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)


def build_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh:
    mesh = init_device_mesh(device.type, dims.shape, mesh_dim_names=DIM_NAMES)
    # A flattened data-parallel dim for loss averaging and FSDP over (replicate x shard) when needed.
    mesh[("dp_replicate", "dp_shard")]._flatten(mesh_dim_name="dp")
    return mesh


def dp_rank(mesh: DeviceMesh) -> int:
    return mesh["dp"].get_local_rank()


def describe(mesh: DeviceMesh) -> dict:
    return {name: mesh[name].size() for name in DIM_NAMES}
