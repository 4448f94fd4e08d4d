"""Checks of the ``comm`` group: every rejection names the key, the reason and the fix (``ConfigError``).

Rules (docs/collectives.md lists them with the presets):
- ``comm.env`` names look like environment variables and values are strings (integers are accepted;
  ``true``/``false``/null/floats/lists are not, since YAML would turn them into ``True``/``None``/...).
- Variables that a typed field owns (TORCH_NCCL_ASYNC_ERROR_HANDLING, TORCH_NCCL_TRACE_BUFFER_SIZE,
  TORCH_NCCL_DUMP_ON_TIMEOUT) are set through that field, not through ``env``.
- NCCL_ALGO / NCCL_PROTO / NCCL_DEBUG / NCCL_NET_GDR_LEVEL values are spelled as NCCL accepts them.
- Transport and variables agree: no NCCL_IB_* tuning on a socket/local preset, no NCCL_IB_DISABLE=1 on an
  InfiniBand/RoCE preset; NCCL_* variables with an explicit gloo backend are rejected (they do nothing).
- ``backend=nccl`` needs a CUDA device: rejected with ``train.device=cpu``.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from lmforge.config.choices import check_choices
from lmforge.config.comm import CommConfig
from lmforge.config.errors import ConfigError

BENCH_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
NCCL_ALGOS = ("ring", "tree", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat")
NCCL_PROTOS = ("ll", "ll128", "simple")
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS", "0", "1", "2", "3", "4", "5")
NCCL_COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "reduce", "sendrecv", "alltoall")
# Set by typed fields of CommConfig; putting them in env would make two sources of truth.
OWNED = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "comm.async_error_handling",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "comm.flight_recorder_entries",
    "TORCH_FR_BUFFER_SIZE": "comm.flight_recorder_entries",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "comm.dump_on_timeout",
}
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_list(key: str, value: str, allowed: tuple, what: str) -> None:
    """NCCL_ALGO/NCCL_PROTO syntax: ``a,b``, ``^a,b`` (exclude), or ``coll:a,b;coll2:^c`` (per collective)."""
    for part in value.split(";"):
        spec = part
        if ":" in part:
            coll, spec = part.split(":", 1)
            if coll.strip().lower() not in NCCL_COLLECTIVES:
                raise ConfigError(
                    key,
                    f"'{coll}' in '{value}' is not an NCCL collective",
                    f"use one of {', '.join(NCCL_COLLECTIVES)} before ':'",
                )
        spec = spec.strip().lstrip("^")
        for name in spec.split(","):
            if name.strip().lower() not in allowed:
                raise ConfigError(
                    key,
                    f"'{name.strip()}' in '{value}' is not a known {what}",
                    f"use a comma-separated list of {', '.join(allowed)} (case-insensitive), "
                    "optionally prefixed by ^ to exclude",
                )


def _env_value(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        shown = "null" if value is None else repr(value)
        raise ConfigError(
            key,
            f"value {shown} ({type(value).__name__}) is not a string; environment variables are "
            "exported verbatim and YAML would turn it into "
            f"'{value}'",
            f'quote the value in YAML, e.g. {key.rsplit(".", 1)[-1]}: "1"',
        )
    return str(value)


def check_comm(comm: CommConfig, device: Optional[str] = None) -> None:
    """Raise ConfigError for an invalid comm group. ``device`` is train.device (auto | cpu | cuda) when known."""
    check_choices(comm, "comm.")  # backend, transport: the values the schema annotates
    for key in ("init_timeout_s", "collective_timeout_s", "preflight_iters", "preflight_max_bytes"):
        if getattr(comm, key) < 1:
            raise ConfigError(f"comm.{key}", f"must be >= 1, got {getattr(comm, key)}", "set a positive value")
    for key in ("flight_recorder_entries", "preflight_floor_gbps"):
        if getattr(comm, key) < 0:
            raise ConfigError(f"comm.{key}", f"must be >= 0, got {getattr(comm, key)}", "set a value >= 0")
    if comm.dump_on_timeout and comm.flight_recorder_entries == 0:
        raise ConfigError(
            "comm.dump_on_timeout",
            "a dump on timeout needs the flight recorder, which is off (flight_recorder_entries=0)",
            "set comm.flight_recorder_entries (e.g. 2000) or comm.dump_on_timeout=false",
        )
    for op in (o.strip() for o in comm.preflight_floor_ops.split(",")):
        if op not in BENCH_OPS:
            raise ConfigError(
                "comm.preflight_floor_ops",
                f"'{op}' is not a bench op",
                f"use a comma-separated list of {', '.join(BENCH_OPS)}",
            )
    if comm.backend == "nccl" and device == "cpu":
        raise ConfigError(
            "comm.backend",
            "nccl needs CUDA devices but train.device=cpu (a gloo-only device)",
            "use comm=cpu_gloo (or comm.backend=auto), or train.device=cuda",
        )

    env = {}
    for name, raw in comm.env.items():
        key = f"comm.env.{name}"
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ConfigError(
                key,
                f"'{name}' is not a valid environment variable name",
                "use letters, digits and underscores, not starting with a digit",
            )
        if name in OWNED:
            raise ConfigError(
                key, f"{name} is set from {OWNED[name]}", f"remove it from comm.env and set {OWNED[name]}"
            )
        env[name] = _env_value(key, raw)

    nccl_vars = sorted(k for k in env if k.startswith("NCCL_"))
    if comm.backend == "gloo" and nccl_vars:
        raise ConfigError(
            f"comm.env.{nccl_vars[0]}",
            "NCCL variables have no effect with comm.backend=gloo",
            "remove the NCCL_* variables or use comm.backend=auto/nccl",
        )
    if "NCCL_ALGO" in env:
        _check_list("comm.env.NCCL_ALGO", env["NCCL_ALGO"], NCCL_ALGOS, "NCCL algorithm")
    if "NCCL_PROTO" in env:
        _check_list("comm.env.NCCL_PROTO", env["NCCL_PROTO"], NCCL_PROTOS, "NCCL protocol")
    if "NCCL_DEBUG" in env and env["NCCL_DEBUG"].upper() not in NCCL_DEBUG_LEVELS:
        raise ConfigError(
            "comm.env.NCCL_DEBUG",
            f"'{env['NCCL_DEBUG']}' is not an NCCL debug level",
            f"use one of {', '.join(NCCL_DEBUG_LEVELS)} (WARN for production, INFO to see transports)",
        )
    if "NCCL_NET_GDR_LEVEL" in env and env["NCCL_NET_GDR_LEVEL"].upper() not in GDR_LEVELS:
        raise ConfigError(
            "comm.env.NCCL_NET_GDR_LEVEL",
            f"'{env['NCCL_NET_GDR_LEVEL']}' is not a GPUDirect RDMA level",
            "use LOC, PIX, PXB, PHB or SYS (or 0-5)",
        )
    if "NCCL_IB_DISABLE" in env and env["NCCL_IB_DISABLE"] not in ("0", "1"):
        raise ConfigError("comm.env.NCCL_IB_DISABLE", f"'{env['NCCL_IB_DISABLE']}' is not 0 or 1", 'use "0" or "1"')
    ib_tuning = [k for k in nccl_vars if k.startswith("NCCL_IB_") and k != "NCCL_IB_DISABLE"]
    if comm.transport in ("socket", "local") and ib_tuning:
        raise ConfigError(
            f"comm.env.{ib_tuning[0]}",
            f"InfiniBand/RoCE variable on a {comm.transport}-only preset "
            f"(comm.transport={comm.transport}), where the IB transport is not used",
            "remove it, or use comm=infiniband / comm=roce",
        )
    if comm.transport in ("infiniband", "roce") and env.get("NCCL_IB_DISABLE") == "1":
        raise ConfigError(
            "comm.env.NCCL_IB_DISABLE",
            f"NCCL_IB_DISABLE=1 turns off the {comm.transport} transport this preset is for",
            'set NCCL_IB_DISABLE "0" or use comm=ethernet',
        )
    if "NCCL_NET_GDR_LEVEL" in env and comm.transport in ("socket", "local"):
        raise ConfigError(
            "comm.env.NCCL_NET_GDR_LEVEL",
            f"GPUDirect RDMA needs an RDMA NIC; comm.transport={comm.transport} has none in use",
            "remove it, or use comm=infiniband / comm=roce",
        )
