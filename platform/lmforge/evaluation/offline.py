"""A checkpoint (any layout) as one process's scorer: the GPT with its full weights and the run's tokenizer.

Used by the ``lm_eval`` adapter (``interop/lm_eval_model.py``) and by tests that score a finished run; the model
is the same ``GPT`` the engines build, fed by ``checkpoint.weights.load_full_model_state``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from lmforge.checkpoint.weights import WeightsError, load_full_model_state, read_sidecar, resolve_checkpoint
from lmforge.config.data import DataConfig
from lmforge.config.errors import ActionableError
from lmforge.config.model import ModelConfig
from lmforge.data.sources import default_cache_dir
from lmforge.data.tokenizer import Tokenizer, load_tokenizer
from lmforge.model.gpt import GPT
from lmforge.model.logprobs import target_logprobs


@dataclass
class LoadedModel:
    model: GPT
    cfg: ModelConfig
    tokenizer: Tokenizer
    checkpoint: Optional[Path]

    @torch.no_grad()
    def token_logprobs(self, tokens: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        out = target_logprobs(self.model(tokens), targets)
        return out[0], out[1] > 0.5


def run_tokenizer(side: dict, ckpt: Path, override: Optional[str] = None) -> Tokenizer:
    """The tokenizer the run trained with (its ``data.tokenizer``; the embedded one from the run's data cache),
    checked against the fingerprint the checkpoint recorded."""
    cfg = side.get("config", {})
    spec = override or str(cfg.get("data", {}).get("tokenizer", "embedded"))
    if spec == "embedded":
        run_dir = ckpt.absolute().parents[1]  # <root>/<run>/checkpoints/step-N
        caches = [
            default_cache_dir(
                DataConfig(cache_dir=cfg.get("data", {}).get("cache_dir")), cfg.get("run", {}).get("root", "runs")
            ),
            run_dir.parent.parent / ".cache" / "lmforge-data",
        ]
        cache = next((c for c in caches if (c / "tokenizers").is_dir()), caches[0])
        tok = load_tokenizer(spec, cache)
    else:
        tok = load_tokenizer(spec)
    want = (side.get("tokenizer") or {}).get("fingerprint")
    if want and tok.fingerprint != want:
        raise WeightsError(
            f"tokenizer {spec} (fingerprint {tok.fingerprint}) is not the one {ckpt} trained with "
            f"(fingerprint {want}). Fix: pass tokenizer=PATH/tokenizer.json of the run, or set "
            "LMFORGE_DATA_CACHE to the run's data cache"
        )
    return tok


def load_checkpoint(path: Path, tokenizer: Optional[str] = None, device: str = "cpu") -> LoadedModel:
    """A run directory or a ``checkpoints/step-N`` directory -> its newest complete checkpoint's model."""
    ckpt = resolve_checkpoint(Path(path))
    side = read_sidecar(ckpt)
    cfg, state = load_full_model_state(ckpt, dtype=torch.float32)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device=device)
    model.init_weights(0, device=torch.device(device))  # the RoPE tables (buffers); the weights come next
    model.load_state_dict(state)
    return LoadedModel(model.eval(), cfg, run_tokenizer(side, ckpt, tokenizer), ckpt)


def untrained_like(loaded: LoadedModel, seed: int) -> LoadedModel:
    """The same shape with lmforge's initialisation (name-keyed, as every run starts): the at-chance control."""
    device = next(loaded.model.parameters()).device
    with torch.device("meta"):
        model = GPT(loaded.cfg)
    model.to_empty(device=device)
    model.init_weights(seed, device=device)
    return LoadedModel(model.eval(), loaded.cfg, loaded.tokenizer, None)


def score_checkpoint(
    path: Path, specs: List[str], limit: int = 0, batch_size: int = 16, control_seed: Optional[int] = None
) -> dict:
    """``eval/<task>/*`` of a checkpoint (and, with ``control_seed``, of the same shape freshly initialised)."""
    from lmforge.evaluation.runner import TaskRunner  # deferred: imports yaml; this module imports without it
    from lmforge.evaluation.tasks import load_tasks  # deferred: imports yaml; this module imports without it

    loaded = load_checkpoint(path)
    runner = TaskRunner(
        load_tasks(specs),
        loaded.tokenizer.encode,
        eod=loaded.tokenizer.eod,
        seq_len=loaded.cfg.seq_len,
        batch_size=batch_size,
        limit=limit,
    )
    out = {
        "checkpoint": str(loaded.checkpoint),
        "trained": runner.run_fn(loaded.token_logprobs, torch.device("cpu"))[0],
    }
    if control_seed is not None:
        control = untrained_like(loaded, control_seed)
        out["untrained"] = runner.run_fn(control.token_logprobs, torch.device("cpu"))[0]
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """python -m lmforge.evaluation.offline RUN_OR_CKPT [--tasks a,b] [--limit N] [--control-seed S]"""
    import argparse
    import json

    from lmforge.evaluation.tasks import shipped_task_names  # deferred: imports yaml; this module imports without it

    p = argparse.ArgumentParser(prog="python -m lmforge.evaluation.offline", description=main.__doc__)
    p.add_argument("path")
    p.add_argument("--tasks", default=",".join(shipped_task_names()))
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--control-seed", type=int, default=None, help="also score the same shape, initialised fresh")
    args = p.parse_args(argv)
    try:
        result = score_checkpoint(
            Path(args.path), args.tasks.split(","), args.limit, args.batch_size, args.control_seed
        )
    except (ActionableError, WeightsError) as err:
        print(f"lmforge: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
