"""lm-evaluation-harness adapter: an lmforge checkpoint as lm-eval's model ``lmforge``.

    python -m lmforge.interop.lm_eval_model --model lmforge --model_args path=runs/smoke --tasks hellaswag ...
    # in Python: import lmforge.interop.lm_eval_model, then lm_eval.simple_evaluate(model="lmforge", ...)

lm-eval 0.4 finds models only in its own registry (no entry points), so the model is registered when this module
is imported; running the module is lm-eval's own command line with it registered. ``--model_args``: ``path`` (a
run directory or ``checkpoints/step-N``, any layout), ``tokenizer`` (default: the run's), ``batch_size``,
``device``, ``max_gen_toks``.

Log-likelihoods are computed by ``lmforge.evaluation.scoring`` (the code the in-loop evaluation runs), so the
adapter's numbers on a task equal the trainer's ``eval/<task>/*`` on the same checkpoint.
"""

from __future__ import annotations

import sys
from typing import List, Optional, Tuple

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from lmforge.evaluation.offline import load_checkpoint
from lmforge.evaluation.scoring import rolling_requests, score
from lmforge.generation.decode import generate as decode


@register_model("lmforge")
class LmforgeLM(TemplateLM):
    def __init__(
        self,
        path: str,
        tokenizer: Optional[str] = None,
        batch_size=16,
        device: str = "cpu",
        max_gen_toks: int = 64,
        **_ignored,
    ):  # lm-eval passes max_batch_size etc. to every model
        super().__init__()
        self.loaded = load_checkpoint(path, tokenizer, device)
        self.tok = self.loaded.tokenizer
        self._device = torch.device(device)
        self._batch_size = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)

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


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    sys.exit(main())
