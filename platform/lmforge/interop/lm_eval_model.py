"""lm-evaluation-harness adapter: an lmforge checkpoint as lm-eval's model ``lmforge``.

    python -m lmforge.interop.lm_eval_model --model lmforge --model_args path=runs/smoke --tasks stdlib_next_line
    # in Python: import lmforge.interop.lm_eval_model, then lm_eval.simple_evaluate(model="lmforge", ...)

lm-eval 0.4 finds models only in its own registry (no entry points), so the model is registered when this module
is imported (with ``lm_eval_hooks.install()``: task-relative data files, quiet git provenance); running the
module is lm-eval's own command line with it registered and lmforge's shipped tasks on the include path.
``--model_args``: ``path`` (a run directory or ``checkpoints/step-N``, any layout), ``tokenizer`` (default: the
run's), ``batch_size`` (default 16), ``device`` (default: the run's, CPU where there is no CUDA),
``max_gen_toks``; ``batch_size`` and ``device`` may as well be lm-eval's ``--batch_size`` / ``--device``.

Log-likelihoods are computed by ``lmforge.evaluation.scoring`` (the code the in-loop evaluation runs), so the
adapter's numbers on a task equal the trainer's ``eval/<task>/*`` on the same checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from lmforge.checkpoint.weights import WeightsError, read_sidecar, resolve_checkpoint
from lmforge.config.errors import ActionableError
from lmforge.evaluation.offline import load_checkpoint
from lmforge.evaluation.scoring import rolling_requests, score
from lmforge.evaluation.tasks import SHIPPED_DIR
from lmforge.generation.decode import generate as decode
from lmforge.interop.lm_eval_hooks import install

install()

DEFAULT_BATCH_SIZE = 16
SHARED = ("batch_size", "device")  # what lm-eval also passes beside --model_args


def default_device(path) -> str:
    """The run's ``train.device`` (its checkpoint's ``state.json``) where this machine has it: ``cpu`` for a CPU
    run, else ``cuda`` when CUDA is available and ``cpu`` when it is not."""
    side = read_sidecar(resolve_checkpoint(Path(path)))
    run_device = ((side.get("config") or {}).get("train") or {}).get("device", "auto")
    return "cuda" if run_device != "cpu" and torch.cuda.is_available() else "cpu"


def merged_args(model_args: dict, additional: Optional[dict]) -> dict:
    """``--model_args`` with what lm-eval passes beside them (``batch_size``, ``device``, ...): a key given both
    ways must agree; None means not given."""
    extra = {k: v for k, v in (additional or {}).items() if v is not None}
    for key in sorted(model_args.keys() & extra.keys()):
        if str(model_args[key]) != str(extra[key]):
            raise ActionableError(
                f"--model_args {key}={model_args[key]}",
                f"disagrees with --{key} {extra[key]}",
                f"give {key} once",
            )
    return {**extra, **model_args}


@register_model("lmforge")
class LmforgeLM(TemplateLM):
    def __init__(
        self,
        path: str,
        tokenizer: Optional[str] = None,
        batch_size=DEFAULT_BATCH_SIZE,
        device: Optional[str] = None,
        max_gen_toks: int = 64,
        **_ignored,
    ):  # lm-eval passes max_batch_size etc. to every model
        super().__init__()
        device = str(device or default_device(path))
        self.loaded = load_checkpoint(path, tokenizer, device)
        self.tok = self.loaded.tokenizer
        self._device = torch.device(device)
        self._batch_size = DEFAULT_BATCH_SIZE if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "LmforgeLM":
        return cls(**merged_args(dict(arg_dict), additional_config))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "LmforgeLM":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ---- what TemplateLM needs ------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def max_length(self) -> int:
        return self.loaded.cfg.seq_len

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens: List[int], **kwargs) -> str:
        return self.tok.decode(tokens)

    def _score(self, requests: List[Tuple[List[int], List[int]]]) -> List[Tuple[float, bool]]:
        return score(
            requests,
            self.loaded.token_logprobs,
            seq_len=self.max_length,
            batch_size=self._batch_size,
            device=self._device,
        )

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        return self._score([(list(ctx), list(cont)) for _, ctx, cont in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        windows, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            for w in rolling_requests(self.tok.encode(text), self.eot_token_id, self.max_length):
                windows.append(w)
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._score(windows)):
            totals[i] += ll
        return totals

    def generate(self, prompt: List[int], max_new_tokens: int) -> List[int]:
        """The one decoding call: greedy with the KV cache (lmforge.generation), stopping after the end-of-document
        token; a context longer than fits with ``max_new_tokens`` in ``seq_len`` is cut from the left."""
        max_new_tokens = min(max_new_tokens, self.max_length - 1)
        (out,) = decode(
            self.loaded.model,
            [prompt[-(self.max_length - max_new_tokens) :]],
            max_new_tokens,
            eos_token_id=self.eot_token_id,
        )
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self.generate(self.tok.encode(context), int(kwargs.get("max_gen_toks", self.max_gen_toks)))
            if ids and ids[-1] == self.eot_token_id:
                ids = ids[:-1]
            text = self.tok.decode(ids)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out


def resolve_cli_args(args) -> None:
    """lm-eval's parsed ``run`` arguments for ``--model lmforge``: ``batch_size`` and ``device`` taken from
    ``--model_args`` or the flags (both ways must agree), defaulted (16; the run's device), and set both ways (lm-eval
    passes its flags to the model beside ``--model_args`` and records them in the results); lmforge's shipped
    tasks put first on the include path. Raises ActionableError on a disagreement or a missing ``path``."""
    model_args = dict(args.model_args or {})
    flags = {"batch_size": getattr(args, "batch_size", None), "device": args.device}  # absent or None: not given
    given = merged_args({k: model_args.pop(k) for k in SHARED if k in model_args}, flags)
    if "path" not in model_args:
        raise ActionableError("--model_args", "path is missing", "pass --model_args path=RUN_DIR_OR_CHECKPOINT")
    args.batch_size = str(given.get("batch_size", DEFAULT_BATCH_SIZE))
    args.device = str(given.get("device") or default_device(model_args["path"]))
    args.model_args = {**model_args, "batch_size": args.batch_size, "device": args.device}  # shown in its header
    args.include_path = [str(SHIPPED_DIR)] + ([args.include_path] if args.include_path else [])


def main() -> int:
    """lm-eval's command line (``lm-eval run ...`` or its legacy form without ``run``), ``lmforge`` registered."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    if getattr(args, "command", None) == "run" and args.model == "lmforge":
        try:
            resolve_cli_args(args)
        except (ActionableError, WeightsError) as err:
            print(f"lmforge lm-eval: {err}", file=sys.stderr)
            return 2
    parser.execute(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
