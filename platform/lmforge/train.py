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

import os

from lmforge.config.compose import compose, conf_dir  # importing compose registers the schema with Hydra
from lmforge.config.errors import ConfigError
from lmforge.runtime.rundir import register_resolvers


def run(cfg: DictConfig, run_dir: Optional[Path] = None) -> int:
    from lmforge.config.validate import validate

    typed = validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))  # the processes actually started
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = Path(HydraConfig.get().runtime.output_dir)
    from lmforge.trainer.trainer import Trainer

    trainer = Trainer(typed, run_dir)
    trainer.fit()
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    import hydra

    from lmforge.config.validate import check_override_keys

    register_resolvers()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    overrides = [a for a in sys.argv[1:] if not a.startswith("-")]
    try:
        check_override_keys(overrides)
        if len(overrides) == len(sys.argv) - 1:  # no Hydra flags (--multirun, --cfg): Hydra's errors as one line
            compose(overrides)
    except ConfigError as e:
        print(f"lmforge: {e}", file=sys.stderr, flush=True)
        return 2

    @hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
    def _app(cfg: DictConfig) -> None:
        try:
            run(cfg)
        except ConfigError as e:
            print(f"lmforge: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    _app()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
