"""The checks of document-masked packing (``data.document_masking``, ``data.document_attention``); docs/data.md.

- Every layout runs it: with pipeline parallelism each stage gets its micro batch's document positions as a
  keyword stage input (lmforge.parallel.pipeline), with context parallelism the exchange masks by document
  (config/context_parallel.py has the cp-specific checks).
- ``flex`` trains on CUDA only: torch 2.13's FlexAttention has no backward on CPU (forward only, eager or
  compiled). On CUDA it needs ``parallelism.compile=true``: eager FlexAttention is torch's unfused reference,
  which materialises the full score matrix (more memory than ``sdpa``). ``sdpa`` is the exact reference on
  every device. ``train.device=auto`` is checked again by the engine once the device is known.
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
    if data.document_attention != "flex":
        return
    if device == "cpu":
        raise ConfigError("data.document_attention", "flex cannot train on the CPU: torch's FlexAttention has no "
                          "backward there", "use data.document_attention=sdpa on the CPU (flex needs CUDA)")
    if device == "cuda" and not par.compile:
        raise ConfigError("data.document_attention", "flex without parallelism.compile=true runs torch's unfused "
                          "FlexAttention on CUDA, which materialises every score (slower and larger than sdpa)",
                          "set parallelism.compile=true, or data.document_attention=sdpa")
