"""The DeepSpeed JSON config the engine starts with: ``lmforge.config.deepspeed`` (which derives it from the
Hydra config, merges the user JSON and holds the checks ``validate()`` runs) with the precision and memory
pinning of the device the engine runs on.
"""

from __future__ import annotations

from typing import Any, Dict

from lmforge.config.batch import BatchPlan
from lmforge.config.deepspeed import generate, load_user_json, merge_user
from lmforge.config.schema import RootConfig


def build_config(cfg: RootConfig, plan: BatchPlan, precision: str, pin_memory: bool = False) -> Dict[str, Any]:
    """The generated dict with ``parallelism.deepspeed_config`` merged over it (``validate()`` has checked the
    rest; a user key that disagrees with the resolved precision or pinning is a ConfigError here)."""
    generated = generate(cfg, plan, precision, pin_memory)
    if cfg.parallelism.deepspeed_config:
        return merge_user(generated, load_user_json(cfg.parallelism.deepspeed_config), cfg.parallelism.deepspeed_config)
    return generated
