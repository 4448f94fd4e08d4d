"""Read DCP checkpoints without arbitrary unpickling.

DCP keeps its index (``.metadata``) as a pickle, and stores non-tensor values (e.g. the optimizer's
``param_groups``) as ``torch.save`` bytes that its default planner loads with ``weights_only=False``.

- ``SafeFileSystemReader`` reads the index with an unpickler that only resolves DCP's own metadata classes,
  ``torch.Size``, dtypes/layouts and paths: a crafted checkpoint cannot run code.
- ``SafeLoadPlanner`` loads byte entries with ``torch.load(weights_only=True)`` (primitives, lists, dicts,
  tuples and tensors only).
Tensor payloads are read by DCP itself with ``weights_only=True``. Every lmforge load uses both.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint._traverse import set_element

_ALLOWED_MODULE_CLASSES = {
    "torch.distributed.checkpoint.metadata": None,  # every name defined there (dataclasses, enums)
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(RuntimeError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_MODULE_CLASSES.get(module, set())
        if module == "torch" and name not in ("Size",):
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
            allowed = set()
        if allowed is None:  # only classes defined in that module itself, not names it imported
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif name in allowed:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"DCP metadata references '{module}.{name}', which is not a checkpoint metadata "
                                    "type; refusing to unpickle it")


def read_metadata_safely(path: Path, name: str = ".metadata") -> Metadata:
    with open(Path(path) / name, "rb") as fh:
        metadata = _MetadataUnpickler(io.BytesIO(fh.read())).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}/{name} does not hold DCP Metadata (got {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read with the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata_safely(Path(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are unpickled with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
