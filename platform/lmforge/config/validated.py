"""``Validated``: what ``config.validate.validate()`` returns, the typed config with its batch plan.

Hydra- and OmegaConf-free (like ``config/schema.py``), so code that builds a config by hand without Hydra
(the GPU check) can hand an engine the same object: ``Validated(root, batch_plan(...))``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from lmforge.config.batch import BatchPlan
from lmforge.config.schema import RootConfig


class Validated(NamedTuple):
    """What ``validate()`` returns: ``cfg, plan = validate(...)``.

    Reading any other attribute reads the config (``validate(...).model`` is ``validate(...).cfg.model``), so
    code that takes "a validated config" takes this object and finds the batch plan on it."""

    cfg: RootConfig
    plan: BatchPlan

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.cfg, name)
