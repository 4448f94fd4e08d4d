"""Where paths from the config may point: nothing a run writes leaves the run root by accident.

- ``run.root``: any directory the user names (absolute, relative to the working directory, even with ``..``):
  setting the root is how a user chooses where runs live.
- ``run.name``, ``run.sweep_point``, ``run.sweep_name``: names *inside* the root (``<root>/<name>``,
  ``<root>/sweeps/<sweep_name>``): relative, no ``..`` component, not absolute.
- ``data.cache_dir``, ``train.resume``, ``train.init_from``: an absolute path (or ``~/...``) is taken as the user
  typed it, wherever it is; a relative path may not climb out with ``..`` (write the absolute path instead).

Every refusal is a ``ConfigError`` naming the key, the reason and the fix (one line, exit 2 from ``lmforge
train``). The rule for names is ``runtime.rundir.escape_reason``, which ``resolve_run_dir`` applies too.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any, Optional

from lmforge.config.errors import ConfigError
from lmforge.runtime.rundir import escape_reason

INSIDE_ROOT = ("run.name", "run.sweep_point", "run.sweep_name")
USER_PATHS = ("data.cache_dir", "train.resume", "train.init_from")
KEYWORDS = {"train.resume": ("auto", "none")}


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if node is None:
            return None
    return node


def _set(value: Any) -> Optional[str]:
    return None if value in (None, "", "null", "None") else str(value)


def check_run_names(run: Any) -> None:
    """``run.name``, ``run.sweep_point`` and ``run.sweep_name`` stay inside ``run.root``."""
    root = _get(run, "root")
    for key in INSIDE_ROOT:
        value = _set(_get(run, key.split(".", 1)[1]))
        if value is None:
            continue
        reason = escape_reason(value)
        if reason is not None:
            last = PurePosixPath(value).name or "myrun"
            last = last if last not in ("..", ".") else "myrun"
            raise ConfigError(
                key,
                f"'{value}' {reason}, so the run would be written outside run.root ({root})",
                f"give a name inside the root (e.g. {key}={last}), or choose the directory with run.root=DIR",
            )


def check_user_paths(cfg: Any) -> None:
    """Relative ``data.cache_dir`` / ``train.resume`` / ``train.init_from`` never climb out with ``..``."""
    for key in USER_PATHS:
        value = _set(_get(cfg, key))
        if value is None or value in KEYWORDS.get(key, ()) or value.startswith("~"):
            continue
        path = PurePosixPath(value)
        if not path.is_absolute() and ".." in path.parts:
            raise ConfigError(
                key,
                f"the relative path '{value}' climbs out with a '..' component",
                "write the absolute path of the directory you mean",
            )


def check_paths(cfg: Any) -> None:
    """Both rules, for a ``RootConfig`` or a composed config's plain container."""
    check_run_names(_get(cfg, "run"))
    check_user_paths(cfg)
