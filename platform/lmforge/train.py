"""Thin Hydra entry point: compose -> validate -> Trainer.fit().

    python -m lmforge.train +exp=smoke optim.lr=1e-3
    lmforge train +exp=gpt_1b cluster.nodes=4
    torchrun --nproc_per_node=2 -m lmforge.train +exp=smoke parallelism=ddp
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig

from lmforge.config.compose import conf_dir  # importing compose registers the schema with Hydra
from lmforge.config.errors import ActionableError, ConfigError
from lmforge.runtime.device_contract import DeviceContractError
from lmforge.runtime.env import launch_world_size
from lmforge.runtime.rundir import register_resolvers


def run(cfg: DictConfig, run_dir: Optional[Path] = None) -> int:
    from lmforge.config.validate import validate
    from lmforge.fault.verdict import VerdictRecorder

    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = Path(HydraConfig.get().runtime.output_dir)
    # An error leaving this block is recorded as this rank's verdict (<run>/verdicts/), read by the launchers.
    with VerdictRecorder(run_dir) as verdict:
        typed = validate(cfg, world_size=launch_world_size() or 1)  # the processes actually started
        from lmforge.data.epochs import check_run
        from lmforge.evaluation.tasks import check_eval_config

        check_eval_config(typed.eval)  # a bad task file is refused before the data is prepared (the Trainer keeps them)

        # a corpus repeated past data.max_epochs is refused before any process group exists (on a fresh cache too:
        # the embedded corpora are prepared here, under their locks, instead of by the trainer's mixture builder)
        check_run(typed, prepare=True)
        from lmforge.trainer.trainer import Trainer

        trainer = Trainer(typed, run_dir)
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

    from lmforge.config.compose import compose
    from lmforge.config.paths import check_run_names

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


def main(argv: Optional[Sequence[str]] = None) -> int:
    import hydra

    from lmforge.config.validate import check_override_keys

    register_resolvers()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    overrides = [a for a in sys.argv[1:] if not a.startswith("-")]
    try:
        check_override_keys(overrides)
        check_run_dir_before_hydra(sys.argv[1:])  # also reports a composition error as one line
    except ConfigError as e:
        print(f"lmforge: {e}", file=sys.stderr, flush=True)
        return 2

    @hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
    def _app(cfg: DictConfig) -> None:
        try:
            run(cfg)
        except (ActionableError, DeviceContractError) as e:  # bad input (config, a refused checkpoint file, ...)
            print(f"lmforge: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    _app()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
