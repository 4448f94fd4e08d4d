"""lmforge.evaluation in one process: lm-eval task files, request construction, log-likelihood scoring against a
direct computation, acc/acc_norm, bits per byte, and the shipped tasks (rebuilt deterministically)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lmforge.config.errors import ConfigError
from lmforge.config.model import ModelConfig
from lmforge.evaluation.bytes import bits_per_byte, token_byte_lengths
from lmforge.evaluation.scoring import encode_pair, rolling_requests, score, task_metrics
from lmforge.evaluation.tasks import SHIPPED_DIR, Request, load_task
from lmforge.model.gpt import GPT
from lmforge.model.logprobs import target_logprobs

DOCS = [
    {"q": "Who wrote Emma?", "options": ["Austen", "Dickens", "Eliot"], "answer": 0},
    {"q": "Which is a snake?", "options": ["python", "gecko", "newt"], "answer": 0},
    {"q": "Two plus two?", "options": ["three", "four", "five"], "answer": 1},
]


def write_task(tmp_path: Path, **overrides) -> Path:
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    spec = {
        "task": "toy",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": "docs.jsonl"}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{q}}\nAnswer:",
        "doc_to_choice": "{{options}}",
        "doc_to_target": "{{answer}}",
        "num_fewshot": 0,
        "metric_list": [{"metric": "acc"}],
        **overrides,
    }
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_task_file_builds_lm_eval_requests(tmp_path):
    task = load_task(str(write_task(tmp_path)))
    reqs = task.all_requests()
    assert reqs[2] == [
        Request("Question: Two plus two?\nAnswer:", " three"),
        Request("Question: Two plus two?\nAnswer:", " four"),
        Request("Question: Two plus two?\nAnswer:", " five"),
    ]
    assert [task.gold(d) for d in task.docs] == [0, 0, 1]
    # k-shot: other documents of the split (never the scored one) as "text target" blocks, then the document
    shot = load_task(str(write_task(tmp_path, num_fewshot=1, description="Quiz.\n\n")))
    ctx = shot.all_requests()[0][0].context
    assert ctx.startswith("Quiz.\n\nQuestion: ") and ctx.endswith("\n\nQuestion: Who wrote Emma?\nAnswer:")
    example = ctx[len("Quiz.\n\n") : -len("\n\nQuestion: Who wrote Emma?\nAnswer:")]
    assert example in ("Question: Which is a snake?\nAnswer: python", "Question: Two plus two?\nAnswer: four")
    assert shot.all_requests()[0][0].context == ctx  # the same contexts at every evaluation
    # field names instead of templates, and a cloze (loglikelihood) task
    with pytest.raises(
        ConfigError, match="doc_to_target gave \\['Austen', 'Dickens', 'Eliot'\\] for a document, not a"
    ):
        load_task(str(write_task(tmp_path, output_type="loglikelihood", doc_to_text="q", doc_to_target="options")))
    cloze = load_task(
        str(write_task(tmp_path, output_type="loglikelihood", doc_to_text="q", doc_to_target="{{options[answer]}}"))
    )
    assert cloze.all_requests()[1] == [Request("Which is a snake?", " python")]


@pytest.mark.parametrize(
    "change, line",
    [
        ({"dataset_path": "hellaswag"}, "dataset_path 'hellaswag' is not local. Fix: use dataset_path: json"),
        ({"process_docs": "x"}, "uses keys lmforge does not implement: process_docs. Fix: remove them"),
        (
            {"output_type": "generate_until"},
            "output_type 'generate_until' is not one of multiple_choice, loglikelihood",
        ),
        ({"dataset_kwargs": {"data_files": {"test": "missing.jsonl"}}}, "missing.jsonl does not exist"),
        ({"doc_to_text": "{{question}}"}, "a doc_to_* template fails on a document ('question' is undefined)"),
    ],
)
def test_bad_task_files_fail_in_one_line(tmp_path, change, line):
    with pytest.raises(ConfigError) as err:
        load_task(str(write_task(tmp_path, **change)))
    msg = str(err.value)
    assert msg.startswith("config key 'eval.tasks': ") and line in msg and "\n" not in msg, msg


def test_python_hooks_in_task_files_are_refused(tmp_path):
    path = write_task(tmp_path)
    path.write_text(path.read_text() + "process_results: !function utils.process\n")
    with pytest.raises(ConfigError, match="uses a '!function' tag"):
        load_task(str(path))
    with pytest.raises(
        ConfigError,
        match="is neither a .yaml file nor a shipped task. Fix: use a task YAML path or "
        "one of: austen_next_sentence, austen_word_order, stdlib_next_line",
    ):
        load_task("austen")


def tiny_gpt(seq_len: int = 16) -> GPT:
    cfg = ModelConfig(name="t", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=seq_len)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights(7)
    return model.eval()


def direct_ll(model: GPT, ctx, cont) -> float:
    """The continuation's log-likelihood from one unpadded forward over the last seq_len+1 tokens."""
    window = (ctx + cont)[-(model.cfg.seq_len + 1) :]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([window[:-1]])).double(), -1)[0]
    n = min(len(cont), len(window) - 1)  # a continuation longer than the window: its last seq_len tokens
    return float(sum(logp[i, window[i + 1]] for i in range(len(window) - 1 - n, len(window) - 1)))


def test_scoring_equals_direct_forward_with_padding_batching_and_truncation():
    model = tiny_gpt()
    fn = lambda x, y: (lambda o: (o[0], o[1] > 0.5))(target_logprobs(model(x), y))  # noqa: E731
    g = torch.Generator().manual_seed(3)
    reqs = [
        (torch.randint(1, 64, (n,), generator=g).tolist(), torch.randint(1, 64, (k,), generator=g).tolist())
        for n, k in [(1, 1), (5, 3), (14, 2), (30, 4), (3, 16), (2, 20)]
    ]  # the last ones are left-truncated
    got = score(reqs, fn, seq_len=16, batch_size=4, device=torch.device("cpu"))
    want = [direct_ll(model, c, k) for c, k in reqs]
    assert [round(a, 4) for a, _ in got] == [round(b, 4) for b in want]
    # negative control: scoring one position too early is a different number
    assert abs(direct_ll(model, reqs[1][0][:-1], reqs[1][0][-1:] + reqs[1][1][:-1]) - want[1]) > 1e-3
    # greedy: a continuation made of the model's own argmax tokens is greedy, a perturbed one is not
    ctx = [5, 9, 11]
    with torch.no_grad():
        nxt = int(model(torch.tensor([ctx]))[0, -1].argmax())
    flags = [
        f
        for _, f in score(
            [(ctx, [nxt]), (ctx, [(nxt + 1) % 64])], fn, seq_len=16, batch_size=4, device=torch.device("cpu")
        )
    ]
    assert flags == [True, False]
    # rolling windows score every token once, the first given the end-of-document token
    toks = list(range(1, 40))
    windows = rolling_requests(toks, 0, 16)
    assert [len(c) for _, c in windows] == [16, 16, 7] and sum((c for _, c in windows), []) == toks
    assert windows[0][0] == [0] and windows[1][0] == toks[:16]


def test_encode_pair_moves_trailing_space_like_lm_eval():
    enc = lambda s: [ord(c) for c in s]  # noqa: E731
    assert encode_pair(enc, 0, "Answer: ", "yes") == (enc("Answer:"), enc(" yes"))
    assert encode_pair(enc, 0, "", "yes") == ([0], enc("yes"))


def test_acc_norm_divides_by_choice_length(tmp_path):
    task = load_task(str(write_task(tmp_path)))
    per_doc = task.all_requests()
    # doc 0: gold "Austen" (6 chars) at -6 loses to "Eliot" (-5.5) unnormalised, wins per character (-1.0 vs -1.1)
    scores = [
        (-6.0, False),
        (-9.0, False),
        (-5.5, False),
        (-1.0, False),
        (-8.0, False),
        (-9.0, False),
        (-7.0, False),
        (-3.0, False),
        (-4.0, False),
    ]
    metrics, records = task_metrics(task, per_doc, scores)
    assert metrics["acc"] == pytest.approx(2 / 3) and metrics["acc_norm"] == pytest.approx(3 / 3)
    assert metrics["ll_gold"] == pytest.approx((-6 - 1 - 3) / 3) and records[0] == {
        "gold": 0,
        "lls": [-6.0, -9.0, -5.5],
    }


def test_bits_per_byte_counts_the_bytes_the_tokens_decode_to(data_cache, tmp_path):
    from lmforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer("embedded", data_cache)
    table = token_byte_lengths(tok, 8192)
    text = "Émile — a naïve café ☃, said Mr. Knightley.\n\tdef f(x):\n        return x ** 2\n"
    ids = tok.encode(text)
    assert int(table[ids].sum()) == len(text.encode("utf-8"))
    assert int(table[tok.eod]) == 0
    # the same tokenizer as a tiktoken file: each token's own bytes, the same table
    from lmforge.data.tokenizer import export_tiktoken

    tt = load_tokenizer(f"tiktoken:{export_tiktoken(Path(tok.source), tmp_path / 'embedded.tiktoken')}")
    assert torch.equal(token_byte_lengths(tt, 8192), table)
    assert bits_per_byte(2.0, 100, 400) == pytest.approx(2.0 * 100 / 400 / math.log(2))


def test_shipped_tasks_are_rebuilt_identically(tmp_path):
    from lmforge.evaluation.build_tasks import build

    build(tmp_path)
    for name in ("austen_next_sentence", "austen_word_order", "stdlib_next_line"):
        meta = yaml.safe_load((SHIPPED_DIR / f"{name}.yaml").read_text())["metadata"]
        built_here = meta.get("python", f"{sys.version_info.major}.{sys.version_info.minor}")
        if built_here == f"{sys.version_info.major}.{sys.version_info.minor}":  # stdlib text is the interpreter's
            assert (tmp_path / f"{name}.jsonl").read_bytes() == (SHIPPED_DIR / f"{name}.jsonl").read_bytes(), name
            assert (tmp_path / f"{name}.yaml").read_bytes() == (SHIPPED_DIR / f"{name}.yaml").read_bytes(), name
        task = load_task(name)
        assert len(task.docs) == 200 and all(len(task.choices(d)) == 4 for d in task.docs)
        golds = [task.gold(d) for d in task.docs]
        assert len(set(golds)) == 4 and max(golds.count(i) for i in range(4)) < 80  # the answer's place is random


def test_offline_scorer_refuses_a_directory_without_a_checkpoint(tmp_path, capsys):
    from lmforge.evaluation.offline import main

    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lmforge: {tmp_path}: no complete checkpoint here") and "\n" not in err
