"""The checks of document-masked packing (``data.document_masking``, ``data.document_attention``); docs/data.md.

- Every layout runs it: with pipeline parallelism each stage gets its micro batch's document positions as a
  keyword stage input (lmforge.parallel.pipeline), with context parallelism the exchange masks by document
  (config/context_parallel.py has the cp-specific checks).
- ``flex`` trains on CUDA only: torch 2.13's FlexAttention has no backward on CPU (forward only, eager or
  compiled). On CUDA it needs ``parallelism.compile=true``: eager FlexAttention is torch's unfused reference,
  which materialises the full score matrix (more memory than ``sdpa``). ``sdpa`` is the exact reference on
  every device. ``varlen`` (torch's ``varlen_attn``, flash attention over the packed documents) runs on CUDA only
  and needs bf16 activations: ``train.precision`` bf16-mixed / bf16 / auto (bf16-mixed on CUDA), or FSDP
  ``param_dtype=bf16``. ``train.device=auto`` is checked again by the engine once the device is known.
"""

from __future__ import annotations

from typing import Optional

from lmforge.config.errors import ConfigError


def check_document_masking(cfg, device: Optional[str] = None) -> None:
    """Raise ConfigError for a document-masking setting this layout or device cannot run. ``device``: the
    resolved device type ("cpu" | "cuda") when known, else train.device (auto | cpu | cuda)."""
    data, par = cfg.data, cfg.parallelism
    device = device or cfg.train.device
    if not data.document_masking:
        return
    if data.document_attention == "flex":
        check_flex(par, device)
    elif data.document_attention == "varlen":
        check_varlen(cfg, device)


def check_flex(par, device: str) -> None:
    if device == "cpu":
        raise ConfigError(
            "data.document_attention",
            "flex cannot train on the CPU: torch's FlexAttention has no backward there",
            "use data.document_attention=sdpa on the CPU (flex needs CUDA)",
        )
    if device == "cuda" and not par.compile:
        raise ConfigError(
            "data.document_attention",
            "flex without parallelism.compile=true runs torch's unfused "
            "FlexAttention on CUDA, which materialises every score (slower and larger than sdpa)",
            "set parallelism.compile=true, or data.document_attention=sdpa",
        )


def check_varlen(cfg, device: str) -> None:
    if device == "cpu":
        raise ConfigError(
            "data.document_attention",
            "varlen cannot run on the CPU: torch's varlen_attn is a CUDA (flash attention) kernel",
            "use data.document_attention=sdpa on the CPU (varlen needs CUDA and bf16)",
        )
    precision, param_dtype = cfg.train.precision, cfg.parallelism.param_dtype
    if precision == "fp32" and param_dtype == "fp32":
        raise ConfigError(
            "data.document_attention",
            "varlen needs bf16 activations (flash attention kernels have "
            f"no fp32), not train.precision={precision} with parallelism.param_dtype={param_dtype}",
            "set train.precision=bf16-mixed (or auto), or data.document_attention=sdpa",
        )
