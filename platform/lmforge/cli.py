"""``lmforge <verb>``: one console entry point for every tool (``USAGE`` is what ``lmforge --help`` prints)."""

from __future__ import annotations

import sys
from typing import Callable, Dict, Optional, Sequence

USAGE = """usage: lmforge VERB ...  (one console entry point for every tool)

  train     [hydra overrides]                 train (same as python -m lmforge.train)
  data      prepare|train-tokenizer|export-tiktoken|debian ...   shards and tokenizers
  plan      [--json] [hydra overrides]        check a layout: mesh, memory per device, step time
  launch    [--nproc N | --slurm] [--dry-run] [hydra overrides]
  comm      bench [--ops ...] [--max-bytes 64M] [--floor-gbps X] [comm=PRESET]   (under torchrun or srun)
  export    hf RUN_DIR_OR_CHECKPOINT OUT_DIR  a Hugging Face checkpoint
  import    hf HF_DIR [--out DIR]             initial weights from a Hugging Face Llama checkpoint
  generate  RUN_OR_CKPT --prompt TEXT [--max-new-tokens N --temperature T --top-k K --top-p P --seed S]
  ckpt      convert SRC DST --to native       DeepSpeed checkpoint -> native (DCP)
  sweep     plan|run|status|collect ...       scaling-law IsoFLOP sweeps
  scaling   fit ...                           Chinchilla Approach 2/3 fits, predictions, plots
  config    show [KEY|GROUP] [hydra overrides]   each key: value, default, choices, meaning, which file set it
  goodput   RUN_OR_SWEEP_DIR [--json]          where the wall time went: goodput, time lost by cause
  wandb     workspace --project P [--out FILE]   a W&B workspace of lmforge's panels (wandb-workspaces)

Run `lmforge VERB --help` for the options of each."""


def _train(argv: Sequence[str]) -> int:
    from lmforge.train import main  # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)

    return main(list(argv))


def _data(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.data.cli import main

    return main(list(argv))


def _export(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.interop.cli import export_main

    return export_main(argv)


def _import(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.interop.cli import import_main

    return import_main(argv)


def _generate(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.interop.cli import generate_main

    return generate_main(argv)


def _comm(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.comm.cli import main

    return main(list(argv))


def _plan(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.parallel.plan_cli import main

    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.trainer.entry_checks import plan_lines

    return main(list(argv), extra_checks=[plan_lines])  # the eval and data lines: lmforge train's entry checks


def _sweep(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.scaling.cli import sweep_main

    return sweep_main(list(argv))


def _scaling(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.scaling.cli import scaling_main

    return scaling_main(list(argv))


def _launch(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.launch.cli import main

    return main(list(argv))


def _ckpt(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.checkpoint.convert import main

    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.optim.adamw import build_optimizer_from_dict

    if not argv or argv[0] != "convert":
        print("usage: lmforge ckpt convert SRC DST --to native", file=sys.stderr)
        return 2
    return main(list(argv[1:]), build_optimizer_from_dict)


def _config(argv: Sequence[str]) -> int:
    from lmforge.config.show import (
        main,  # deferred: a subcommand's module loads only when it runs (`--help` stays light)
    )

    return main(list(argv))


def _wandb(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.metrics.wandb_workspace import main

    return main(list(argv))


def _goodput(argv: Sequence[str]) -> int:
    # deferred: a verb's module loads only when it runs (`lmforge --help` imports none)
    from lmforge.fault.goodput_cli import main

    return main(list(argv))


VERBS: Dict[str, Callable[[Sequence[str]], int]] = {
    "train": _train,
    "data": _data,
    "export": _export,
    "import": _import,
    "generate": _generate,
    "comm": _comm,
    "plan": _plan,
    "sweep": _sweep,
    "scaling": _scaling,
    "launch": _launch,
    "ckpt": _ckpt,
    "config": _config,
    "goodput": _goodput,
    "wandb": _wandb,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        import difflib

        near = difflib.get_close_matches(verb, list(VERBS), n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        print(f"lmforge: unknown verb '{verb}'{hint}; verbs: {', '.join(sorted(VERBS))}", file=sys.stderr)
        return 2
    return VERBS[verb](rest)


if __name__ == "__main__":
    raise SystemExit(main())
