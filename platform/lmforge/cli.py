"""``lmforge <verb>``: one console entry point for every tool.

    lmforge train   [hydra overrides]     train (same as python -m lmforge.train)
    lmforge data    prepare|train-tokenizer ...
    lmforge ckpt    convert SRC DST --to native       DeepSpeed checkpoint -> native (DCP)
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, Optional, Sequence


def _train(argv: Sequence[str]) -> int:
    from lmforge.train import main

    return main(list(argv))


def _data(argv: Sequence[str]) -> int:
    from lmforge.data.cli import main

    return main(list(argv))


def _ckpt(argv: Sequence[str]) -> int:
    from lmforge.checkpoint.convert import main
    from lmforge.trainer.optim import build_optimizer_from_dict

    if not argv or argv[0] != "convert":
        print("usage: lmforge ckpt convert SRC DST --to native", file=sys.stderr)
        return 2
    return main(list(argv[1:]), build_optimizer_from_dict)


VERBS: Dict[str, Callable[[Sequence[str]], int]] = {
    "train": _train,
    "data": _data,
    "ckpt": _ckpt,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nverbs: " + ", ".join(sorted(VERBS)))
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
