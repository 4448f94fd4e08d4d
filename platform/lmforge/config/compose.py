"""Locate the Hydra config tree and compose configs without running an app (tests, ``lmforge plan``)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import List, Optional, Sequence

from omegaconf import DictConfig

from lmforge.config.errors import ConfigError
from lmforge.config.schema import RootConfig
from lmforge.config.validate import _closest, _schema_at, _valid_keys, check_override_keys
from lmforge.runtime.env_vars import read
from lmforge.runtime.rundir import register_resolvers


def register_schema() -> None:
    """Register ``RootConfig`` as ``lmforge_schema`` (the first default of conf/config.yaml); idempotent."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="lmforge_schema", node=RootConfig)


register_schema()  # on import: ``lmforge.train`` imports this module before ``@hydra.main`` composes


def conf_dir() -> Path:
    """The ``conf/`` tree: $LMFORGE_CONF_DIR, else the one beside ``platform/`` in the source checkout."""
    env = read("LMFORGE_CONF_DIR")
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


def compose(
    overrides: Optional[Sequence[str]] = None, config_name: str = "config", return_hydra_config: bool = False
) -> DictConfig:
    """Compose ``conf/config.yaml`` with command-line style overrides, exactly as ``lmforge train`` would
    (``return_hydra_config``: with the ``hydra`` node, whose ``runtime.choices`` names the preset of each group)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_resolvers()
    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    overrides_list: List[str] = list(overrides or [])
    check_override_keys(overrides_list)
    from hydra.errors import CompactHydraException

    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return hydra_compose(
                config_name=config_name, overrides=overrides_list, return_hydra_config=return_hydra_config
            )
    except CompactHydraException as e:
        raise composition_error(e, overrides_list) from None


def composition_error(exc: Exception, overrides: Sequence[str]) -> ConfigError:
    """Hydra's multi-line composition error as one ConfigError line: the key (or group), the file, the fix."""
    text = str(exc)
    missing = re.search(r"Could not find '([^']+)/([^']+)'", text)
    options = list(getattr(exc, "options", None) or [])
    if missing and options:
        group, name = missing.groups()
        key = next(
            (o.split("=", 1)[0].lstrip("+~") for o in overrides if o.lstrip("+~").startswith(f"{group}=")), group
        )
        near = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
        hint = f"did you mean '{near[0]}'? " if near else ""
        return ConfigError(
            key,
            f"'{name}' is not one of {', '.join(options)} (no {group}/{name}.yaml in {conf_dir()})",
            f"{hint}choose one of {', '.join(options)}",
        )
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    detail = str(cause)
    full_key = re.search(r"full_key: (\S+)", detail)
    reason = detail.splitlines()[0] if detail.strip() else type(cause).__name__
    where = re.match(r"In '([^']+)': ", text)
    merging = re.match(r"Error merging override (\S+)", text)
    if where and where.group(1) != "config":
        reason = f"{text.split(chr(10))[1] if chr(10) in text else reason} (in {conf_dir() / where.group(1)}.yaml)"
    elif merging:
        reason = f"{reason} (command-line override {merging.group(1)})"
    if full_key and reason.startswith("Key '"):  # an unknown key inside a YAML file
        parts = full_key.group(1).split(".")
        names = _valid_keys(_schema_at(parts[:-1]))
        near = _closest(parts[-1], names)
        fix = f"did you mean '{'.'.join(parts[:-1] + [near])}'?" if near else f"valid keys here: {', '.join(names)}"
        return ConfigError(full_key.group(1), reason, fix)
    if full_key:
        return ConfigError(full_key.group(1), reason, "give a value of the schema's type")
    override = getattr(exc, "override", None)
    if override is not None:  # a command line Hydra cannot parse
        return ConfigError(
            str(override), reason, "write overrides as key=value (quote values holding '=', ',' or brackets)"
        )
    return ConfigError("(composition)", reason, "fix the override or YAML file named above")
