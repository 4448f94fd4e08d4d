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

``build_mesh`` returns a :class:`ParallelMesh`: the root DeviceMesh and the flattened meshes ``_flatten()`` made,
kept by name, so ``mesh["dp"]`` or ``mesh["dp_replicate", "dp_shard_cp"]`` never slices a flattened dim from the
root (deprecated since torch 2.11, with a warning at every start). The answer is the same DeviceMesh the root
slice gave (same ranks, same process groups, a new object per call): a flattened dim's own mesh, concatenated
with root dims where several are named (``DeviceMesh._concatenate``, what FSDP2 itself uses for HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple, Union

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


class ParallelMesh:
    """The root DeviceMesh and its flattened dims by name; ``mesh[name]`` / ``mesh[names]`` is a DeviceMesh."""

    def __init__(self, root: DeviceMesh, flattened: Dict[str, DeviceMesh]):
        self.root, self.flattened = root, dict(flattened)

    def __getitem__(self, names: Union[str, Tuple[str, ...]]) -> DeviceMesh:
        names = (names,) if isinstance(names, str) else tuple(names)
        if not any(n in self.flattened for n in names) or not hasattr(DeviceMesh, "_concatenate"):
            return self.root[names]  # (torch before _concatenate slices flattened dims from the root, silently)
        return DeviceMesh._concatenate([self.flattened[n] if n in self.flattened else self.root[n] for n in names])


def build_mesh(dims: ParallelDims, device: torch.device) -> ParallelMesh:
    if dims.ep > 1:
        root = init_device_mesh(
            device.type,
            (dims.pp, dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep, dims.cp, dims.tp),
            mesh_dim_names=EP_DIM_NAMES,
        )
        return ParallelMesh(
            root,
            {  # (cp > 1 with ep > 1 is refused by config/moe_checks.py)
                "dp_shard": root["dp_shard_mod_ep", "ep"]._flatten(mesh_dim_name="dp_shard"),
                "dp": root["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten(mesh_dim_name="dp"),
            },
        )
    root = init_device_mesh(device.type, dims.shape, mesh_dim_names=DIM_NAMES)
    # A flattened data-parallel dim for loss averaging and FSDP over (replicate x shard) when needed.
    flattened = {"dp": root["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")}
    if dims.cp > 1:  # (only then: each flattened dim is a new process group)
        flattened["dp_shard_cp"] = root["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
        flattened["dp_cp"] = root["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="dp_cp")
    return ParallelMesh(root, flattened)


def dp_rank(mesh: ParallelMesh) -> int:
    return mesh["dp"].get_local_rank()
