"""How much of lmforge a reader walks through from ``lmforge train +exp=smoke`` to the first ``optimizer.step()``.

    LMFORGE_DATA_CACHE=<a built data cache> python -m benchmarks.reading_path [--json OUT] [overrides...]

Runs ``lmforge train +exp=smoke train.max_steps=1`` in this process (``lmforge.cli.main``, the console entry
point) under ``sys.setprofile`` on the main thread, and stops at the first ``torch.optim.Optimizer.step`` (a
global step pre-hook prints the figures and exits the process at once; nothing after the step runs). Counted:

  functions      distinct lmforge functions called (each ``def``/``lambda`` code object once; comprehensions,
                 generator expressions and module bodies not counted)
  files          distinct lmforge files with at least one of those functions
  modules        lmforge modules whose body ran (imported) on the way
  stack depth    frames on the stack when the optimizer step runs: lmforge frames, and all frames (torch,
                 hydra, ...) between the entry point and the step
  the stack      the lmforge frames of that stack, outermost first, as file:line function

Point ``LMFORGE_DATA_CACHE`` at a built cache (tokenizer, shards: e.g. the test suite's
``LMFORGE_TEST_DATA_CACHE``) so the run does not build them first; building them changes no figure but the time.
Extra arguments are Hydra overrides appended to the run's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "lmforge"


def _is_lmforge(filename: str) -> bool:
    return filename.startswith(str(PACKAGE) + os.sep)


def _rel(filename: str) -> str:
    return str(Path(filename).relative_to(PACKAGE.parent))


class PathRecorder:
    """The profile function: every Python call whose code lives in the lmforge package."""

    def __init__(self) -> None:
        self.functions: Set[Tuple[str, int, str]] = set()
        self.modules: Set[str] = set()

    def __call__(self, frame, event, arg):  # noqa: ARG002
        if event != "call":
            return
        code = frame.f_code
        if not _is_lmforge(code.co_filename):
            return
        if code.co_name == "<module>":
            self.modules.add(code.co_filename)
        elif not code.co_name.startswith("<") or code.co_name == "<lambda>":
            self.functions.add((code.co_filename, code.co_firstlineno, code.co_qualname))


def stack_at(frame, stop_code) -> List[Tuple[str, int, str]]:
    """(file, line, function) of every frame from ``frame`` out to (not including) ``stop_code``'s, outermost first."""
    out = []
    while frame is not None and frame.f_code is not stop_code:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_qualname))
        frame = frame.f_back
    return out[::-1]


def report(recorder: PathRecorder, stack: List[Tuple[str, int, str]]) -> Dict:
    lm_stack = [f"{_rel(f)}:{line} {name}" for f, line, name in stack if _is_lmforge(f)]
    return {
        "functions": len(recorder.functions),
        "files": len({f for f, _, _ in recorder.functions}),
        "modules": len(recorder.modules),
        "stack_depth_lmforge": len(lm_stack),
        "stack_depth_all": len(stack),
        "stack": lm_stack,
        "stack_all": [f"{f}:{line} {name}" for f, line, name in stack],
        "files_list": sorted({_rel(f) for f, _, _ in recorder.functions}),
    }


def print_table(r: Dict) -> None:
    rows = [
        ("lmforge functions called", r["functions"]),
        ("lmforge files (with a called function)", r["files"]),
        ("lmforge modules imported", r["modules"]),
        ("stack depth at optimizer.step: lmforge frames", r["stack_depth_lmforge"]),
        ("stack depth at optimizer.step: all frames", r["stack_depth_all"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("lmforge train +exp=smoke -> first optimizer.step()")
    for k, v in rows:
        print(f"  {k:<{width}}  {v:>5}")
    print("lmforge stack at the step (outermost first):")
    for line in r["stack"]:
        print(f"  {line}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reading_path", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None, help="also write the figures, file list and full stack here")
    args, extra = p.parse_known_args(argv)
    root = tempfile.mkdtemp(prefix="lmforge-reading-path-")
    overrides = ["+exp=smoke", "train.max_steps=1", f"run.root={root}", "logging.console=plain", *extra]
    recorder = PathRecorder()
    entry_code = main.__code__

    import torch.optim.optimizer as optimizer_mod

    def at_first_step(optimizer, a, kw):  # noqa: ARG001
        sys.setprofile(None)
        r = report(recorder, stack_at(sys._getframe(1), entry_code))  # from the entry point to the step
        print_table(r)
        if args.json is not None:
            args.json.write_text(json.dumps(r, indent=2) + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    optimizer_mod.register_optimizer_step_pre_hook(at_first_step)
    sys.setprofile(recorder)
    from lmforge.cli import main as lmforge_main

    rc = lmforge_main(["train", *overrides])
    sys.setprofile(None)
    print(f"reading_path: the run ended (exit {rc}) without an optimizer step", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
