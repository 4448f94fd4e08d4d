"""What changes in lm-evaluation-harness once lmforge's model is registered (``install()``, called on import of
``lmforge.interop.lm_eval_model``):

- a task file's local ``dataset_kwargs.data_files`` (``dataset_path`` json, csv, parquet, text or arrow) that are
  relative paths are read against the task file's directory, the rule lmforge's own task loader follows, so the
  shipped tasks and task files meant for both run from any working directory (lm-eval itself reads them against
  the working directory);
- the results' ``git_hash`` is asked of git with its stderr kept: outside a git checkout lm-eval's own call
  printed ``fatal: not a git repository``; that case now falls back quietly (as lm-eval does after it), any
  other git failure is printed.

Both replace lm-eval 0.4's functions by name (``lm_eval.tasks._yaml_loader.load_yaml`` and its import in
``lm_eval.tasks._factory``, ``lm_eval.evaluator.get_git_commit_hash``); ``tests/e2e/test_lm_eval_adapter.py`` runs the documented command
from another directory and checks both.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")  # datasets' packaged loaders of local files
NOT_A_REPOSITORY = "not a git repository"


def task_relative(files: Any, base: Path) -> Any:
    """``data_files`` (a path, a list of paths, or a split -> path(s) mapping) with relative local paths joined
    to ``base``; absolute paths and URLs unchanged."""
    if isinstance(files, dict):
        return {split: task_relative(f, base) for split, f in files.items()}
    if isinstance(files, (list, tuple)):
        return [task_relative(f, base) for f in files]
    if isinstance(files, str) and "://" not in files and not Path(files).expanduser().is_absolute():
        return str(base / files)
    return files


def with_task_relative_data(cfg: dict, task_file: Path) -> dict:
    """A loaded task config whose local data files are read against ``task_file``'s directory."""
    kwargs = cfg.get("dataset_kwargs")
    if cfg.get("dataset_path") not in LOCAL_BUILDERS or not isinstance(kwargs, dict) or "data_files" not in kwargs:
        return cfg
    base = Path(task_file).expanduser().resolve().parent
    return {**cfg, "dataset_kwargs": {**kwargs, "data_files": task_relative(kwargs["data_files"], base)}}


def git_commit_hash(fallback: Callable[[str], Optional[str]], run=subprocess.run) -> Optional[str]:
    """``git describe --always`` of the working directory, as lm-eval records it; outside a checkout (or without
    git) ``fallback(cwd)``, lm-eval's reading of ``.git`` files, with nothing printed; any other failure of git
    is printed to stderr before falling back."""
    try:
        done = run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
    except FileNotFoundError:  # no git on this machine
        return fallback(os.getcwd())
    if done.returncode == 0:
        return done.stdout.strip()
    if NOT_A_REPOSITORY not in done.stderr:
        sys.stderr.write(done.stderr)
    return fallback(os.getcwd())


def install() -> None:
    """Wrap lm-eval's task-file loader (where the task index builds a task, and where ``--tasks FILE.yaml`` is
    read) and its git provenance; idempotent."""
    import lm_eval.evaluator as evaluator
    import lm_eval.tasks._factory as factory
    import lm_eval.tasks._yaml_loader as yaml_loader
    from lm_eval.loggers.utils import get_commit_from_path

    if not getattr(yaml_loader.load_yaml, "lmforge_task_relative", False):
        load_yaml = yaml_loader.load_yaml

        def load_task_yaml(path, *args, **kwargs):
            return with_task_relative_data(load_yaml(path, *args, **kwargs), Path(path))

        load_task_yaml.lmforge_task_relative = True
        yaml_loader.load_yaml = factory.load_yaml = load_task_yaml
    evaluator.get_git_commit_hash = lambda: git_commit_hash(get_commit_from_path)
