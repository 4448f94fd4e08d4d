"""Thin Hydra entry point: compose -> validate -> entry_checks (once) -> Trainer.fit().

python -m lmforge.train +exp=smoke optim.lr=1e-3
lmforge train +exp=gpt_1b cluster.nodes=4
torchrun --nproc_per_node=2 -m lmforge.train +exp=smoke parallelism=ddp
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from lmforge.config.compose import (
    compose,
    composition_error,
    conf_dir,  # importing compose registers the schema with Hydra
)
from lmforge.config.errors import ActionableError, ConfigError
from lmforge.config.paths import check_run_names
from lmforge.config.validate import check_override_keys, validate
from lmforge.fault.verdict import VerdictRecorder
from lmforge.runtime.device_contract import DeviceContractError
from lmforge.runtime.env import launch_world_size
from lmforge.runtime.rundir import register_resolvers


def run(cfg: DictConfig, run_dir: Optional[Path] = None) -> int:
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = Path(HydraConfig.get().runtime.output_dir)
    # An error leaving this block is recorded as this rank's verdict (<run>/verdicts/), read by the launchers.
    with VerdictRecorder(run_dir) as verdict:
        typed = validate(cfg, world_size=launch_world_size() or 1)  # the processes actually started
        from lmforge.trainer.entry_checks import entry_checks  # deferred: imports numpy; this module imports without it

        # Once, before any process group: the eval tasks, the tokenizer, train.resume's checkpoint against this
        # model and tokenizer (before any corpus is tokenized for it), then data.max_epochs with the embedded
        # corpora prepared (trainer/entry_checks.py). The Trainer uses what they resolved, loading nothing again.
        checks = entry_checks(typed, prepare=True, run_dir=run_dir)
        from lmforge.trainer.trainer import Trainer  # deferred: imports numpy, torch; this module imports without it

        trainer = Trainer(typed, run_dir, checked=checks)
        verdict.step = lambda: trainer.step
        trainer.fit()
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


def _app(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ActionableError, DeviceContractError) as e:  # bad input (config, a refused checkpoint file, ...)
        print(f"lmforge: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def run_composed_once(overrides: Sequence[str]) -> None:
    """``@hydra.main``'s run for plain overrides, with the config composed once (hydra.main composes it twice,
    once for ``hydra.mode``, and the run-name check needed a third composition): compose as Hydra's own run
    does, check the run names on that composition, then Hydra's ``run_job`` (run dir, .hydra/, job logging)."""
    from hydra import initialize_config_dir
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import run_job
    from hydra.errors import CompactHydraException
    from hydra.types import HydraContext, RunMode
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(conf_dir()), job_name="train", version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        try:
            # hydra.mode=RUN: what hydra.main adds when the config sets no mode (recorded in .hydra/hydra.yaml)
            cfg = hydra.compose_config(
                config_name="config",
                overrides=[*overrides, "hydra.mode=RUN"],
                run_mode=RunMode.RUN,
                with_log_configuration=True,
            )
        except CompactHydraException as e:
            raise composition_error(e, list(overrides)) from None
        check_run_names(OmegaConf.to_container(cfg.run, resolve=True))  # before run_job makes hydra.run.dir

        def job() -> None:
            callbacks = Callbacks(cfg)
            callbacks.on_run_start(config=cfg, config_name="config")
            ret = run_job(
                hydra_context=HydraContext(config_loader=hydra.config_loader, callbacks=callbacks),
                task_function=_app,
                config=cfg,
                job_dir_key="hydra.run.dir",
                job_subdir_key=None,
                configure_logging=True,
            )
            callbacks.on_run_end(config=cfg, config_name="config", job_return=ret)
            _ = ret.return_value  # re-raises the job's exception, reported as hydra.main reports it

        run_and_report(job)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import hydra

    register_resolvers()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    overrides = [a for a in sys.argv[1:] if not a.startswith("-")]
    try:
        check_override_keys(overrides)
        if len(overrides) == len(sys.argv[1:]):  # no Hydra flag (-m, -cn, --cfg, ...): what every worker runs
            run_composed_once(overrides)
            return 0
        check_run_dir_before_hydra(sys.argv[1:])  # also reports a composition error as one line
    except ConfigError as e:
        print(f"lmforge: {e}", file=sys.stderr, flush=True)
        return 2

    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_app)()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
