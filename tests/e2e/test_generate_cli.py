"""`lmforge generate RUN_OR_CKPT`, in-process, on a run directory holding a checkpoint of a small random GPT with
the embedded tokenizer (recorded in its state.json as a training run records it): the printed text is the prompt +
the decoded KV-cached tokens of `lmforge.generation.generate`, a seed reproduces a sample, `--stop` cuts after its
text; bad input exits 2 with one line and no traceback. (Layouts: tests/e2e/test_interop_hf_e2e.py decodes an
FSDP2-sharded checkpoint through the same loader.)"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from lmforge.checkpoint.manager import CheckpointManager
from lmforge.cli import main
from lmforge.config.checkpoint import CheckpointConfig
from lmforge.config.model import ModelConfig
from lmforge.data.tokenizer import load_tokenizer
from lmforge.generation import generate
from lmforge.interop.generate import load_for_generation
from lmforge.model.gpt import GPT

PROMPT = "It is a truth universally acknowledged, that a single man"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache) -> Path:
    cfg = ModelConfig(name="g", vocab_size=8192, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=64)
    model = GPT(cfg)
    model.init_weights(0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    tok = load_tokenizer("embedded", data_cache)
    run = tmp_path_factory.mktemp("generate") / "run"
    sidecar = {
        "config": {"model": asdict(cfg), "data": {"tokenizer": "embedded"}, "run": {"root": str(run.parent)}},
        "tokenizer": tok.identity,
        "world_size": 1,
    }
    CheckpointManager(run / "checkpoints", CheckpointConfig()).save(7, model, None, sidecar)
    return run


def run(capsys, *argv):
    rc = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_prints_the_cached_greedy_continuation(run_dir, capsys):
    loaded = load_for_generation(run_dir)
    assert loaded.checkpoint.name == "step-00000007"
    tok = loaded.tokenizer
    ids = generate(loaded.model, [tok.encode(PROMPT)], 16, eos_token_id=tok.eod)[0]
    assert len(ids) == 16 and tok.eod not in ids
    assert ids == generate(loaded.model, [tok.encode(PROMPT)], 16, eos_token_id=tok.eod, use_cache=False)[0]
    rc, out, err = run(capsys, run_dir, "--prompt", PROMPT, "--max-new-tokens", 16)
    assert rc == 0, err
    assert out == PROMPT + tok.decode([t for t in ids if t != tok.eod]) + "\n"

    sample = [
        run_dir,
        "--prompt",
        PROMPT,
        "--prompt",
        "Emma",
        "--max-new-tokens",
        12,
        "--temperature",
        1.0,
        "--top-k",
        40,
        "--top-p",
        0.95,
    ]
    a, b, c = (run(capsys, *sample, "--seed", s)[1] for s in (1, 1, 2))
    assert a == b and a != c and a.count("\n---\n") == 1 and a.startswith(PROMPT)

    continuation = out[len(PROMPT) : -1]
    stop = continuation.strip()[:3]
    rc, cut, _ = run(capsys, run_dir, "--prompt", PROMPT, "--max-new-tokens", 16, "--stop", stop)
    assert rc == 0 and cut == PROMPT + continuation[: continuation.index(stop) + len(stop)] + "\n"


def test_bad_input_exits_2_with_one_line(run_dir, tmp_path, capsys):
    cases = {
        (str(tmp_path / "nope"), "--prompt", "x"): "does not exist. Fix:",
        (str(tmp_path), "--prompt", "x"): "no complete checkpoint here",
        (str(run_dir), "--prompt", "x", "--max-new-tokens", "5000"): "exceeds the model's context",
        (str(run_dir), "--prompt", "x", "--top-p", "1.5"): "top_p 1.5: must be in (0, 1]",
    }
    for argv, expected in cases.items():
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and out == "", argv
        assert err.count("\n") == 1 and err.startswith("lmforge generate: ") and expected in err, err
        assert "Traceback" not in err
