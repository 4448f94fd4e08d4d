"""HF interop end to end: a tiny model trained by `python -m lmforge.train` on the embedded real text is exported,
loaded with `LlamaForCausalLM.from_pretrained`, compared logit by logit and token by token; then imported back
and trained with FSDP2 on 2 real ranks from the imported weights, and that sharded checkpoint exports identically.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from harness import run_ranks
from lmforge.checkpoint.weights import load_full_model_state, read_metadata_safely
from lmforge.cli import main as lmforge_main
from lmforge.data.embedded import iter_documents
from lmforge.data.tokenizer import load_tokenizer
from lmforge.interop.generate import greedy_generate
from lmforge.model.gpt import GPT

TINY = ["model=tiny", "train.micro_batch_size=4", "train.global_batch_size=4", "train.eval_every=0",
        "optim.warmup_steps=0", "logging.console=plain"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data_cache) -> Path:
    """A tiny GQA model (4 query / 2 kv heads, untied), 6 steps on the embedded mixture, single process."""
    root = tmp_path_factory.mktemp("interop-runs")
    cmd = [sys.executable, "-m", "lmforge.train", *TINY, "train.max_steps=6", "optim.lr=3e-3",
           f"run.root={root}", "run.name=single"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LMFORGE_DATA_CACHE": str(data_cache)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "single"


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("interop-hf") / "tiny-hf"
    assert lmforge_main(["export", "hf", str(trained), str(out)]) == 0
    return out


def real_text() -> str:
    chapter = next(d for d in iter_documents("books") if len(d) > 5000)  # Emma, chapter I
    return chapter[1000:1600]


def lmforge_model(ckpt: Path) -> GPT:
    cfg, state = load_full_model_state(ckpt)
    model = GPT(cfg)
    model.init_weights(0)
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.timeout(400)
def test_trained_model_matches_transformers_logits_and_greedy_tokens(trained, exported, data_cache):
    names = sorted(p.name for p in exported.iterdir())
    assert names == ["config.json", "generation_config.json", "lmforge_export.json", "model.safetensors",
                     "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    ckpt = trained / "checkpoints" / "step-00000006"
    ours = lmforge_model(ckpt)
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    our_tok = load_tokenizer("embedded", data_cache)

    text = real_text()
    ids = our_tok.encode(text)[:64]
    assert len(ids) == 64
    assert hf_tok(text)["input_ids"][:64] == ids  # the exported tokenizer is the run's tokenizer
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = ours(x), theirs(x).logits
    assert a.shape == b.shape == (1, len(ids), 8192)
    assert (a - b).abs().max().item() < 1e-4

    prompt = ids[:24]
    mine = greedy_generate(ours, prompt, 20, eos_token_id=our_tok.eod)
    hf_out = theirs.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=20, do_sample=False)
    assert hf_out[0, len(prompt):].tolist() == mine
    assert len(mine) == 20, f"generation stopped early at EOD: {mine}"
    config = json.loads((exported / "config.json").read_text())
    assert config["eos_token_id"] == our_tok.eod and config["num_key_value_heads"] == 2


@pytest.mark.timeout(400)
@pytest.mark.distributed
def test_fsdp2_checkpoint_from_imported_weights_exports_identically(exported, tmp_path, data_cache):
    """import hf -> train 2 ranks with FSDP2 (lr 0: weights unchanged) -> export == the single-process export."""
    imported = tmp_path / "imported"
    assert lmforge_main(["import", "hf", str(exported), "--out", str(imported), "--name", "tiny_import"]) == 0
    exp = imported / "conf" / "exp" / "tiny_import.yaml"
    assert "init_from: " + str(imported / "checkpoints" / "step-00000000") in exp.read_text()

    argv = ["--config-dir", str(imported / "conf"), "+exp=tiny_import", "parallelism=fsdp", *TINY[1:],
            "train.micro_batch_size=2", "train.max_steps=1", "optim.lr=0.0", f"run.root={tmp_path}",
            "run.name=fsdp"]
    run_ranks("e2e.interop_ranks:train", 2, {"argv": argv}, timeout=300,
              env={"LMFORGE_DATA_CACHE": str(data_cache)})
    ckpt = tmp_path / "fsdp" / "checkpoints" / "step-00000001"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    chunks = read_metadata_safely(ckpt).state_dict_metadata["model.layers.0.attention.wq.weight"].chunks
    assert len(chunks) == 2  # really sharded over the two ranks

    again = tmp_path / "again-hf"
    assert lmforge_main(["export", "hf", str(tmp_path / "fsdp"), str(again)]) == 0
    from safetensors.torch import load_file

    single, sharded = load_file(str(exported / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert set(single) == set(sharded)
    for name in single:
        assert torch.equal(single[name], sharded[name]), name
    assert json.loads((again / "config.json").read_text()) == json.loads((exported / "config.json").read_text())
