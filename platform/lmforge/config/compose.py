"""Locate the Hydra config tree and compose configs without running an app (tests, ``lmforge plan``)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Sequence

from omegaconf import DictConfig

from lmforge.config.schema import RootConfig
from lmforge.config.validate import check_override_keys
from lmforge.runtime.rundir import register_resolvers


def register_schema() -> None:
    """Register ``RootConfig`` as ``lmforge_schema`` (the first default of conf/config.yaml); idempotent."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="lmforge_schema", node=RootConfig)


register_schema()  # on import: ``lmforge.train`` imports this module before ``@hydra.main`` composes


def conf_dir() -> Path:
    """The ``conf/`` tree: $LMFORGE_CONF_DIR, else the one beside ``platform/`` in the source checkout."""
    env = os.environ.get("LMFORGE_CONF_DIR")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve()
    candidate = here.parents[3] / "conf"
    if (candidate / "config.yaml").exists():
        return candidate
    raise FileNotFoundError(
        f"lmforge's conf/ tree was not found at {candidate}. Install lmforge from its source checkout "
        "(pip install -e .) or set LMFORGE_CONF_DIR to the conf/ directory."
    )


def compose(overrides: Optional[Sequence[str]] = None, config_name: str = "config") -> DictConfig:
    """Compose ``conf/config.yaml`` with command-line style overrides, exactly as ``lmforge train`` would."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_resolvers()
    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    overrides_list: List[str] = list(overrides or [])
    check_override_keys(overrides_list)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides_list, return_hydra_config=False)
