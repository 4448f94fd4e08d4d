"""Thin Hydra entry point: compose (once) -> the run directory -> trainer.startup.train (the one start-up path).

python -m lmforge.train +exp=smoke optim.lr=1e-3
lmforge train +exp=gpt_1b cluster.nodes=4
torchrun --nproc_per_node=2 -m lmforge.train +exp=smoke parallelism=ddp
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from lmforge.config.compose import (
    compose,
    composition_error,
    conf_dir,  # importing compose registers the schema with Hydra
)
from lmforge.config.errors import ActionableError, ConfigError
from lmforge.config.paths import check_run_names
from lmforge.config.validate import check_override_keys
from lmforge.runtime.device_contract import DeviceContractError
from lmforge.runtime.env_vars import launch_world_size, read
from lmforge.runtime.rundir import made_by_launch, register_resolvers, remove_refused


def run(cfg: DictConfig, run_dir: Optional[Path] = None) -> int:
    """Train ``cfg`` in ``run_dir`` (None: Hydra's run directory, under ``@hydra.main``) through the one start-up
    path (``trainer.startup.train``: validate, the entry checks, the Trainer, the loop, this rank's verdict)."""
    from lmforge.trainer.startup import train  # deferred: imports torch; this module imports without it

    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = Path(HydraConfig.get().runtime.output_dir)
    train(cfg, run_dir)
    return 0


def check_run_dir_before_hydra(args: Sequence[str]) -> None:
    """Refuse a run name that leaves run.root (config/paths.py) before Hydra creates the run directory.

    ``@hydra.main`` makes ``hydra.run.dir`` before our code sees the config, so the names are checked on a
    composition of their own (from the command line and any ``+exp`` file). A multirun's per-job directories are
    Hydra's sweep dir (checked by ``validate`` in each job); a composition error is left to Hydra to report."""
    if any(a in ("-m", "--multirun") for a in args):
        return
    tree_flags = ("-cp", "--config-path", "-cd", "--config-dir")
    if any(a in tree_flags or a.startswith(tuple(f + "=" for f in tree_flags)) for a in args):
        return  # another config tree: composing the default one here would be wrong; validate() checks the names
    from omegaconf import OmegaConf

    overrides, config_name, flag = [], "config", None
    for a in args:
        if flag is not None:  # the value of the flag before
            config_name = a if flag in ("-cn", "--config-name") else config_name
            flag = None
        elif a in ("-cn", "--config-name", "-c", "--cfg", "-p", "--package"):
            flag = a
        elif a.startswith("--config-name="):
            config_name = a.split("=", 1)[1]
        elif not a.startswith("-"):
            overrides.append(a)
    try:
        run = OmegaConf.to_container(compose(overrides, config_name=config_name).run, resolve=True)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - Hydra reports its own composition errors below, in its own words
        return
    check_run_names(run)


def forget_refused_start(run_dir: Path, made: Optional[Path]) -> bool:
    """A refused start leaves no run directory behind when this launch made it (``made``: the outermost directory
    it created, ``runtime.rundir.made_by_launch``) and it holds only what the refusal wrote (Hydra's record and
    log, the verdict). Not under a launcher that reads the verdicts there (``LMFORGE_RUN_DIR``: torchrun's agent,
    slurm/train.sh, ``lmforge launch``), and not with several processes, which share the directory."""
    if made is None or read("LMFORGE_RUN_DIR") or (launch_world_size() or 1) > 1:
        return False
    return remove_refused(run_dir, made)


def _app(cfg: DictConfig, run_dir: Optional[Path] = None, made: Optional[Path] = None) -> None:
    try:
        run(cfg, run_dir)
    except (ActionableError, DeviceContractError) as e:  # bad input (config, a refused checkpoint file, ...)
        print(f"lmforge: {e}", file=sys.stderr, flush=True)
        if run_dir is None:
            from hydra.core.hydra_config import HydraConfig

            run_dir = Path(HydraConfig.get().runtime.output_dir)
        forget_refused_start(run_dir, made)
        raise SystemExit(2) from None


def run_composed_once(overrides: Sequence[str]) -> bool:
    """``@hydra.main``'s run for plain overrides, with the config composed once (hydra.main composes it twice,
    once for ``hydra.mode``, and the run-name check needed a third composition), through Hydra's public Compose
    API: compose, check the run names on that composition, record the run as ``@hydra.main`` does
    (``record_run``), then the task. False, having run nothing, when the config names ``hydra.callbacks``:
    ``@hydra.main`` runs those (``main`` starts through it then)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import env_override
    from hydra.errors import CompactHydraException

    with initialize_config_dir(config_dir=str(conf_dir()), job_name="train", version_base="1.3"):
        try:
            # hydra.mode=RUN: what hydra.main adds when the config sets no mode (recorded in .hydra/hydra.yaml)
            cfg = compose(config_name="config", overrides=[*overrides, "hydra.mode=RUN"], return_hydra_config=True)
        except CompactHydraException as e:
            raise composition_error(e, list(overrides)) from None
    if OmegaConf.select(cfg, "hydra.callbacks"):
        return False
    check_run_names(OmegaConf.to_container(cfg.run, resolve=True))  # before the run directory is resolved and made
    made = made_by_launch(Path(str(OmegaConf.select(cfg, "hydra.run.dir"))))  # removed again if the start is refused
    before, cwd = HydraConfig.instance().cfg, os.getcwd()
    HydraConfig.instance().set_config(cfg)  # HydraConfig.get() and ${hydra:...} read this run's
    try:
        task_cfg, run_dir = record_run(cfg)
        with env_override(cfg.hydra.job.env_set):
            _app(task_cfg, run_dir, made)
    finally:
        HydraConfig.instance().cfg = before
        os.chdir(cwd)  # hydra.job.chdir=true: back where the caller was (a later start in this process)
    return True


def record_run(cfg: DictConfig) -> Tuple[DictConfig, Path]:
    """What ``@hydra.main`` records for a run: ``hydra.run.dir`` resolved (``runtime.rundir.resolve_run_dir``: the
    same directory on every rank and restart) and made, ``hydra.runtime.output_dir`` set, Hydra's and the job's
    logging configured, .hydra/ written (config.yaml, hydra.yaml, overrides.yaml). Returns the task's config (the
    hydra node left out) and the run directory."""
    import copy

    from hydra.core.utils import configure_log
    from omegaconf import open_dict, read_write

    run_dir = Path(str(OmegaConf.select(cfg, "hydra.run.dir"))).absolute()
    with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):
        cfg.hydra.runtime.output_dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.hydra.job.chdir:
        os.chdir(run_dir)
    configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
    configure_log(cfg.hydra.job_logging, cfg.hydra.verbose)
    task_cfg = copy.deepcopy(cfg)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    if cfg.hydra.output_subdir is not None:
        record = run_dir / str(cfg.hydra.output_subdir)
        record.mkdir(parents=True, exist_ok=True)
        hydra_cfg = OmegaConf.masked_copy(cfg, "hydra")
        for name, node in (
            ("config.yaml", task_cfg),
            ("hydra.yaml", hydra_cfg),
            ("overrides.yaml", cfg.hydra.overrides.task),
        ):
            (record / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")
    return task_cfg, run_dir


def main(argv: Optional[Sequence[str]] = None) -> int:
    import hydra

    register_resolvers()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    overrides = [a for a in sys.argv[1:] if not a.startswith("-")]
    try:
        check_override_keys(overrides)
        if len(overrides) == len(sys.argv[1:]) and run_composed_once(overrides):  # no Hydra flag: every worker
            return 0
        check_run_dir_before_hydra(sys.argv[1:])  # also reports a composition error as one line
    except ConfigError as e:
        print(f"lmforge: {e}", file=sys.stderr, flush=True)
        return 2

    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_app)()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
