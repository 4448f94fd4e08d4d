"""The one reader of checkpoint files: tensors and JSON only, a few allow-listed types, no arbitrary unpickling.

Every load path (native resume, DeepSpeed resume, ``lmforge ckpt convert``, ``lmforge export hf``,
``train.init_from``, sweep resume) reads checkpoint files through this module:

- ``read_metadata_safely`` / ``tensor_metadata``: DCP keeps its index (``.metadata``) as a pickle; it is read with
  an unpickler that resolves only DCP's own metadata classes, ``torch.Size``, dtypes/layouts and paths.
- ``load_dcp``: ``dcp.load`` with ``SafeFileSystemReader`` (the index as above) and ``SafeLoadPlanner`` (non-tensor
  entries, e.g. the optimizer's ``param_groups``, with ``torch.load(weights_only=True)``: primitives, lists,
  dicts, tuples, tensors). DCP itself reads tensor payloads with ``weights_only=True``.
- ``weights_only_loads``: for libraries that call ``torch.load(weights_only=False)`` themselves (DeepSpeed's
  ``load_checkpoint`` and ``ds_to_universal``): every ``torch.load`` inside is forced to ``weights_only=True``
  (also through ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, for any alias of ``torch.load``) with exactly the allow-listed
  extra types (``DEEPSPEED_GLOBALS``).
- ``read_json``: the sidecar and other state files are JSON.

Whatever is refused raises ``UnsafeCheckpointError``: one line naming the file, the reason and the fix.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lmforge.config.errors import ActionableError
from lmforge.runtime.env_vars import read

TRUST_FIX = (
    "load only checkpoints written by lmforge (tensors + JSON); re-save a checkpoint of unknown origin "
    "in an isolated, trusted environment first"
)

_ALLOWED_MODULE_CLASSES = {
    "torch.distributed.checkpoint.metadata": None,  # every name defined there (dataclasses, enums)
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}

# "module:qualname" of every non-tensor type DeepSpeed 0.19 pickles into its checkpoint files.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",  # ZeRO optimizer state: the (static) loss scaler
    "deepspeed.utils.tensor_fragment:fragment_address",  # ZeRO-1/2 param_slice_mappings
    "deepspeed.runtime.zero.config:ZeroStageEnum",  # the ZeRO stage recorded in optimizer state
)


class UnsafeCheckpointError(ActionableError):
    """A checkpoint file that would need arbitrary unpickling (or is not what it claims to be): refused."""

    def __init__(self, file: Any, reason: str, fix: str = TRUST_FIX):
        self.file = str(file)
        super().__init__(f"checkpoint file {file}", reason, fix)


def _one_line(text: str, limit: int = 300) -> str:
    """The informative first line of torch's multi-paragraph weights_only message."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    pick = next(
        (ln for ln in lines if "GLOBAL" in ln or "not an allowed global" in ln or "WeightsUnpickler" in ln),
        lines[0] if lines else "",
    )
    return pick[:limit]


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
        raise pickle.UnpicklingError(f"it references '{module}.{name}', which is not a checkpoint metadata type")


def read_metadata_safely(path: Path, name: str = ".metadata") -> Metadata:
    file = Path(path) / name
    try:
        with open(file, "rb") as fh:
            metadata = _MetadataUnpickler(io.BytesIO(fh.read())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError) as e:
        raise UnsafeCheckpointError(
            file,
            f"refused: {_one_line(e)}; DCP metadata is never unpickled beyond its own "
            "types (a crafted file could run code)",
        ) from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(file, f"does not hold DCP Metadata (got {type(metadata).__name__})")
    return metadata


def tensor_metadata(path: Path) -> Dict[str, Any]:
    """{flattened key: DCP storage metadata} of the checkpoint at ``path``, read safely."""
    return read_metadata_safely(Path(path)).state_dict_metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read with the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = read_metadata_safely(Path(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are unpickled with ``weights_only=True``."""

    def __init__(self, *args: Any, source: Optional[Path] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.source = source

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f"{self.source or '?'} (DCP entry '{fqn}')",
                f"refused: {_one_line(e)}; only tensors, numbers, strings, lists, tuples and dicts are loaded",
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _refusal_inside(err: BaseException, path: Path) -> Optional[UnsafeCheckpointError]:
    """The UnsafeCheckpointError (or weights_only refusal) DCP wrapped in its per-rank CheckpointException."""
    seen: List[BaseException] = [err]
    failures = getattr(err, "failures", None) or {}
    for item in failures.values():
        seen.append(item[0] if isinstance(item, tuple) else item)
    for e in seen:
        if isinstance(e, UnsafeCheckpointError):
            return e
        if isinstance(e, pickle.UnpicklingError):
            return UnsafeCheckpointError(path, f"a tensor file was refused: {_one_line(e)}")
    return None


def load_dcp(state: Dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """``dcp.load(state)`` from checkpoint ``path``, safely (see the module doc). Refusals raise
    ``UnsafeCheckpointError`` on every rank that reads the file, before any tensor is touched."""
    path = Path(path)
    read_metadata_safely(path)  # refuse a crafted index up front, with its own message
    try:
        dcp.load(
            state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(source=path), no_dist=no_dist
        )
    except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures (a BaseException)
        refusal = _refusal_inside(e, path)
        if refusal is not None:
            raise refusal from None
        raise


def allowed_globals(specs: Sequence[str]) -> List[Any]:
    import importlib

    out = []
    for spec in specs:
        module, name = spec.split(":")
        out.append(getattr(importlib.import_module(module), name))
    return out


@contextlib.contextmanager
def weights_only_loads(allowed: Sequence[str] = DEEPSPEED_GLOBALS) -> Iterator[None]:
    """Inside: every ``torch.load`` runs with ``weights_only=True`` (a library passing False is overridden) and only
    ``allowed`` ("module:qualname") added to torch's safe types; a refusal raises ``UnsafeCheckpointError`` naming
    the file. Process-wide while active (torch.load is a module attribute); loads run on the calling thread."""
    real_load = torch.load

    def safe_load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return real_load(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(
                f if isinstance(f, (str, os.PathLike)) else "<stream>",
                f"refused: {_one_line(e)}; only tensors, primitives and the allow-listed "
                f"types ({', '.join(allowed) or 'none'}) are loaded",
            ) from None

    saved_env = read("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    with torch.serialization.safe_globals(allowed_globals(allowed)):
        torch.load = safe_load
        os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
        try:
            yield
        finally:
            torch.load = real_load
            if saved_env is None:
                os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
            else:
                os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = saved_env


def load_torch_file(path: Path, allowed: Sequence[str] = ()) -> Any:
    """One ``torch.save`` file, tensors and primitives only (plus ``allowed`` types)."""
    with weights_only_loads(allowed):
        return torch.load(str(path), map_location="cpu")


def read_json(path: Path) -> Any:
    """A JSON state file (the sidecar ``state.json``, a sweep plan): never anything but JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UnsafeCheckpointError(
            path, "is not JSON text (binary content; a pickle is never read as state)"
        ) from None
    except json.JSONDecodeError as e:
        raise UnsafeCheckpointError(
            path,
            f"is not valid JSON ({e.msg} at line {e.lineno})",
            "restore the file from the run that wrote it, or resume from another checkpoint",
        ) from None
