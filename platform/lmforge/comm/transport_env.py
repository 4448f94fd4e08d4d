"""The transport environment of a ``comm`` preset: what it sets, exporting it, recording it in the run dir.

``comm_environment`` is pure (config in, variables out) so tests and ``lmforge plan`` can show exactly what a
preset will export. ``export_comm_env`` applies it before any process group exists; a variable the user
already set in the environment (``srun --export``, a site profile) wins and is recorded as ``inherited``.
"""

from __future__ import annotations

import json
import os
import re
from importlib.metadata import version
from pathlib import Path
from typing import Dict, Optional

from lmforge.config.comm import CommConfig
from lmforge.runtime.env_vars import already_set, matching
from lmforge.runtime.file_modes import write_text
from lmforge.runtime.secrets import redact

# Environment prefixes that matter to collectives; recorded (redacted) in comm_env.json even when not set by us.
RELEVANT_PREFIXES = (
    "NCCL_",
    "TORCH_NCCL_",
    "TORCH_FR_",
    "GLOO_",
    "TORCH_DISTRIBUTED_",
    "UCX_",
    "FI_",
    "CUDA_VISIBLE_DEVICES",
    "MASTER_ADDR",
    "MASTER_PORT",
)


# The flight recorder's variables by torch version. Since 2.8 torch reads the vendor-neutral TORCH_FR_* names
# first and warns (once, on stderr) when it falls back to an older TORCH_NCCL_* spelling that is set; before 2.8
# it reads only the TORCH_NCCL_* names. So exactly one spelling is exported: the one this torch reads without a
# warning. (ProcessGroupNCCL's own dump switch still reads TORCH_NCCL_TRACE_BUFFER_SIZE, default 2000 > 0: dumps
# stay on without it.)
FR_NAMES_SINCE = (2, 8)
FR_NAMES = {"buffer_size": "TORCH_FR_BUFFER_SIZE", "dump_file": "TORCH_FR_DUMP_TEMP_FILE"}
OLDER_FR_NAMES = {"buffer_size": "TORCH_NCCL_TRACE_BUFFER_SIZE", "dump_file": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
# A user's value under the other spelling wins like any inherited value (export_comm_env).
SPELLINGS = {FR_NAMES[k]: OLDER_FR_NAMES[k] for k in FR_NAMES} | {OLDER_FR_NAMES[k]: FR_NAMES[k] for k in FR_NAMES}


def flight_recorder_names(torch_version: Optional[str] = None) -> Dict[str, str]:
    """{"buffer_size", "dump_file"}: the variable names the given (default: installed) torch reads."""
    found = re.match(r"(\d+)\.(\d+)", torch_version or version("torch"))
    newer = found is None or (int(found.group(1)), int(found.group(2))) >= FR_NAMES_SINCE
    return FR_NAMES if newer else OLDER_FR_NAMES


def comm_environment(
    cfg: CommConfig, dump_dir: Optional[Path] = None, torch_version: Optional[str] = None
) -> Dict[str, str]:
    """Every variable the preset sets, as strings (the values have passed ``check_comm``), with the flight
    recorder's names for ``torch_version`` (default: the installed torch)."""
    env = {str(k): str(v) for k, v in cfg.env.items()}
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3" if cfg.async_error_handling else "0"
    if cfg.flight_recorder_entries > 0:
        names = flight_recorder_names(torch_version)
        env[names["buffer_size"]] = str(cfg.flight_recorder_entries)
        if cfg.dump_on_timeout:
            env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
            if dump_dir is not None:
                # torch appends the rank: <run>/dumps/nccl_trace_rank_<r>
                env[names["dump_file"]] = str(Path(dump_dir) / "nccl_trace_rank_")
    return env


def export_comm_env(cfg: CommConfig, dump_dir: Optional[Path] = None) -> Dict[str, Dict[str, str]]:
    """Export the preset's variables (user env wins). Returns {name: {"value", "source": preset|inherited}}."""
    applied: Dict[str, Dict[str, str]] = {}
    preset = comm_environment(cfg, dump_dir)
    inherited = already_set([*preset, *(SPELLINGS[k] for k in preset if k in SPELLINGS)])  # a user's value wins
    for key, value in preset.items():
        spelled = key if key in inherited else SPELLINGS.get(key) if SPELLINGS.get(key) in inherited else None
        if spelled is not None:  # the user's value (under either spelling of a flight recorder name) wins
            applied[spelled] = {"value": inherited[spelled], "source": "inherited", "preset_value": value}
        else:
            os.environ[key] = value
            applied[key] = {"value": value, "source": "preset"}
    if dump_dir is not None and (FR_NAMES["dump_file"] in applied or OLDER_FR_NAMES["dump_file"] in applied):
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
    return applied


def comm_env_record(cfg: CommConfig, applied: Dict[str, Dict[str, str]], backend: str, world_size: int) -> dict:
    other = {k: v for k, v in matching(RELEVANT_PREFIXES).items() if k not in applied}
    return redact(
        {
            "preset": cfg.name,
            "backend": backend,
            "transport": cfg.transport,
            "world_size": world_size,
            "collective_timeout_s": cfg.collective_timeout_s,
            "variables": applied,
            "other_environment": other,
        }
    )


def write_comm_env(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    write_text(tmp, json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, path)
