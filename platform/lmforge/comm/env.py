"""The transport environment of a ``comm`` preset: what it sets, exporting it, recording it in the run dir.

``comm_environment`` is pure (config in, variables out) so tests and ``lmforge plan`` can show exactly what a
preset will export. ``export_comm_env`` applies it before any process group exists; a variable the user
already set in the environment (``srun --export``, a site profile) wins and is recorded as ``inherited``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional

from lmforge.config.comm import CommConfig
from lmforge.runtime.env import already_set, matching
from lmforge.runtime.secrets import redact

# Environment prefixes that matter to collectives; recorded (redacted) in comm_env.json even when not set by us.
RELEVANT_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_DISTRIBUTED_", "UCX_", "FI_", "CUDA_VISIBLE_DEVICES",
                     "MASTER_ADDR", "MASTER_PORT")


def comm_environment(cfg: CommConfig, dump_dir: Optional[Path] = None) -> Dict[str, str]:
    """Every variable the preset sets, as strings (the values have passed ``check_comm``)."""
    env = {str(k): str(v) for k, v in cfg.env.items()}
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3" if cfg.async_error_handling else "0"
    if cfg.flight_recorder_entries > 0:
        # Both spellings: TORCH_FR_* are the newer names, TORCH_NCCL_* the older ones torch still reads.
        env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = env["TORCH_FR_BUFFER_SIZE"] = str(cfg.flight_recorder_entries)
        if cfg.dump_on_timeout:
            env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
            if dump_dir is not None:
                # torch appends the rank: <run>/dumps/nccl_trace_rank_<r>
                prefix = str(Path(dump_dir) / "nccl_trace_rank_")
                env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = env["TORCH_FR_DUMP_TEMP_FILE"] = prefix
    return env


def export_comm_env(cfg: CommConfig, dump_dir: Optional[Path] = None) -> Dict[str, Dict[str, str]]:
    """Export the preset's variables (user env wins). Returns {name: {"value", "source": preset|inherited}}."""
    applied: Dict[str, Dict[str, str]] = {}
    preset = comm_environment(cfg, dump_dir)
    inherited = already_set(preset)  # a value the user set wins
    for key, value in preset.items():
        if key in inherited:
            applied[key] = {"value": inherited[key], "source": "inherited", "preset_value": value}
        else:
            os.environ[key] = value
            applied[key] = {"value": value, "source": "preset"}
    if dump_dir is not None and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in applied:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
    return applied


def comm_env_record(cfg: CommConfig, applied: Dict[str, Dict[str, str]], backend: str, world_size: int) -> dict:
    other = {k: v for k, v in matching(RELEVANT_PREFIXES).items() if k not in applied}
    return redact({"preset": cfg.name, "backend": backend, "transport": cfg.transport, "world_size": world_size,
                   "collective_timeout_s": cfg.collective_timeout_s, "variables": applied, "other_environment": other})


def write_comm_env(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, path)
