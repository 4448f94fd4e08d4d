"""Log-likelihood scoring of (context, continuation) requests, batched, on whatever computes per-token log-probs.

Token requests are built as lm-evaluation-harness builds them (``TemplateLM._encode_pair``): trailing whitespace of
the context moves to the continuation, the pair is encoded whole and the continuation is what follows the
context's own encoding; an empty context is the end-of-document token. The model sees the last ``seq_len`` tokens
of context + continuation (left truncation), right-padded to ``seq_len`` so every batch has one shape on every
layout. The log-likelihood is the sum over the continuation's tokens; ``greedy`` says each of them was the argmax.

``score`` takes a ``logprob_fn(tokens, targets) -> (logp, greedy)`` (an engine's ``token_logprobs``, or a bare
GPT in one process) and, in a data-parallel job, the ``dp`` (rank, size, group): batch ``b`` is computed by
data-parallel rank ``b % size`` and the results are summed over the group, so every rank returns all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lmforge.evaluation.tasks import Request, Task

LogprobFn = Callable[[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
TokenRequest = Tuple[List[int], List[int]]


@dataclass(frozen=True)
class DataParallel:
    rank: int
    size: int
    group: Any  # a torch.distributed process group (None: the default group)


def encode_pair(encode: Callable[[str], List[int]], eod: int, context: str, continuation: str) -> TokenRequest:
    """lm-eval's split of a (context, continuation) pair into token ids."""
    if context == "":  # the end-of-document token is the context (or the continuation's own first token, if it is)
        cont = encode(continuation)
        return (cont[:1], cont[1:]) if cont and cont[0] == eod else ([eod], cont)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx) :]


def rolling_requests(tokens: List[int], eod: int, seq_len: int) -> List[TokenRequest]:
    """A whole text's log-likelihood as disjoint windows: each scores up to ``seq_len`` new tokens given the
    tokens just before them (the first given the end-of-document token), so every token is scored once."""
    out = []
    for start in range(0, len(tokens), seq_len):
        out.append((([eod] + tokens[:start])[-seq_len:], tokens[start : start + seq_len]))
    return out


def _row(request: TokenRequest, seq_len: int) -> Tuple[List[int], List[int], int, int]:
    ctx, cont = request
    if not cont:
        raise ValueError("a request with an empty continuation has no log-likelihood")
    window = (list(ctx) + list(cont))[-(seq_len + 1) :]
    inp, tgt = window[:-1], window[1:]
    n_cont = min(len(cont), len(tgt))
    return inp, tgt, len(tgt) - n_cont, len(tgt)  # tokens, targets, first and end scored position


@torch.no_grad()
def score(
    requests: Sequence[TokenRequest],
    logprob_fn: LogprobFn,
    *,
    seq_len: int,
    batch_size: int,
    device: torch.device,
    dp: Optional[DataParallel] = None,
) -> List[Tuple[float, bool]]:
    """(sum log-likelihood of the continuation, is it the greedy continuation) per request, in order."""
    rows = [_row(r, seq_len) for r in requests]
    n_batches = math.ceil(len(rows) / batch_size) if rows else 0
    size, rank = (dp.size, dp.rank) if dp is not None else (1, 0)
    n_batches = math.ceil(n_batches / size) * size  # every rank runs the same number of forwards
    results = torch.zeros(len(rows), 2, dtype=torch.float64, device=device)
    for b in range(rank, n_batches, size):
        chunk = list(range(b * batch_size, min((b + 1) * batch_size, len(rows))))
        pad = [([], [], 0, 0)] * (batch_size - len(chunk))  # padding rows: every batch has one shape
        batch = [rows[j] for j in chunk] + pad
        tokens = torch.tensor([inp + [0] * (seq_len - len(inp)) for inp, _, _, _ in batch], dtype=torch.long)
        targets = torch.tensor([tgt + [0] * (seq_len - len(tgt)) for _, tgt, _, _ in batch], dtype=torch.long)
        mask = torch.tensor([[lo <= t < hi for t in range(seq_len)] for _, _, lo, hi in batch], device=device)
        logp, greedy = logprob_fn(tokens.to(device), targets.to(device))
        ll = (logp.double() * mask).sum(1)
        is_greedy = (greedy | ~mask).all(1).double()
        if chunk:
            results[chunk[0] : chunk[-1] + 1] = torch.stack([ll, is_greedy], 1)[: len(chunk)]
    if size > 1:
        import torch.distributed as dist

        dist.all_reduce(results, group=dp.group)  # collective: each rank filled only its own batches
    return [(float(a), bool(b > 0.5)) for a, b in results.cpu().tolist()]


# ---- task metrics (lm-eval's definitions) -------------------------------------------------------------------
def task_metrics(
    task: Task, per_doc: List[List[Request]], scores: List[Tuple[float, bool]], limit: int = 0
) -> Tuple[Dict[str, float], List[Dict[str, Any]]]:
    """``acc``/``acc_norm`` (multiple_choice: argmax of the log-likelihoods, and of log-likelihood per character
    of the choice, as lm-eval's ``acc_norm``), or ``acc`` (greedy) for loglikelihood tasks; with the mean
    log-likelihood of the correct choice (``ll_gold``) and of the others (``ll_other``). Also each document's
    per-choice log-likelihoods."""
    docs = task.docs[:limit] if limit else task.docs
    it = iter(scores)
    acc = acc_norm = ll_gold = ll_other = 0.0
    n_other = 0
    records = []
    for doc, reqs in zip(docs, per_doc):
        got = [next(it) for _ in reqs]
        lls = [s[0] for s in got]
        if task.output_type == "multiple_choice":
            gold, choices = task.gold(doc), task.choices(doc)
            best = max(range(len(lls)), key=lambda i: (lls[i], -i))
            norm = [ll / len(c) for ll, c in zip(lls, choices)]
            best_norm = max(range(len(norm)), key=lambda i: (norm[i], -i))
            acc += best == gold
            acc_norm += best_norm == gold
            ll_gold += lls[gold]
            ll_other += sum(lls) - lls[gold]
            n_other += len(lls) - 1
            records.append({"gold": gold, "lls": lls})
        else:
            acc += got[0][1]
            ll_gold += lls[0]
            records.append({"ll": lls[0], "greedy": got[0][1]})
    n = max(len(records), 1)
    out = {"acc": acc / n, "ll_gold": ll_gold / n}
    if task.output_type == "multiple_choice":
        out["acc_norm"] = acc_norm / n
        out["ll_other"] = ll_other / max(n_other, 1)
    return out, records
