"""HF interop end to end, one training launch:

transformers writes a tiny Llama (lm_head zeroed)  --lmforge import hf-->  step-0 checkpoint + exp config
--lmforge train --config-dir ... +exp=... parallelism=fsdp  (2 real ranks, 6 steps on the embedded real text)-->
FSDP2-sharded checkpoint  --lmforge export hf-->  LlamaForCausalLM.from_pretrained: logits within 1e-4 of
lmforge's on an Austen passage, identical greedy tokens (uncached, and KV-cached through `lmforge generate`'s
loader); import that export (a single-process checkpoint) and export it again: bit-identical to the export of
the sharded one.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from harness import run_ranks

from lmforge.checkpoint.weights import load_full_model_state, read_metadata_safely
from lmforge.cli import main as lmforge_main
from lmforge.data.embedded import iter_documents
from lmforge.data.tokenizer import build_embedded_tokenizer, load_tokenizer
from lmforge.generation import generate
from lmforge.interop.generate import load_for_generation
from lmforge.model.gpt import GPT

VOCAB = 8192


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("interop-e2e")


@pytest.fixture(scope="module")
def hf_source(work, data_cache) -> Path:
    """A Llama written by transformers in conf/model/tiny.yaml's shape (GQA 4q/2kv, untied), lm_head = 0, with the
    embedded BPE as its tokenizer.json."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # all logits 0: the first loss is exactly ln(vocab) iff these weights are used
    src = work / "hf-source"
    model.save_pretrained(str(src))
    shutil.copyfile(build_embedded_tokenizer(data_cache), src / "tokenizer.json")
    return src


@pytest.fixture(scope="module")
def fsdp_run(work, hf_source, data_cache) -> Path:
    imported = work / "imported"
    assert lmforge_main(["import", "hf", str(hf_source), "--out", str(imported), "--name", "tiny_hf"]) == 0
    exp = (imported / "conf" / "exp" / "tiny_hf.yaml").read_text()
    assert f"init_from: {imported / 'checkpoints' / 'step-00000000'}" in exp and "n_kv_heads: 2" in exp
    argv = [
        "--config-dir",
        str(imported / "conf"),
        "+exp=tiny_hf",
        "parallelism=fsdp",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.max_steps=6",
        "train.eval_every=0",
        "optim.lr=3e-3",
        "optim.warmup_steps=0",
        "logging.console=plain",
        f"run.root={work}",
        "run.name=fsdp",
    ]
    run_ranks("e2e.interop_ranks:train", 2, {"argv": argv}, timeout=400, env={"LMFORGE_DATA_CACHE": str(data_cache)})
    return work / "fsdp"


@pytest.fixture(scope="module")
def exported(fsdp_run, work) -> Path:
    out = work / "tiny-hf"
    assert lmforge_main(["export", "hf", str(fsdp_run), str(out)]) == 0
    return out


def real_text() -> str:
    chapter = next(d for d in iter_documents("books") if len(d) > 5000)  # Emma, chapter I
    return chapter[1000:1600]


@pytest.mark.timeout(500)
@pytest.mark.distributed
def test_training_starts_from_imported_weights_on_fsdp2_ranks(fsdp_run):
    records = [json.loads(line) for line in (fsdp_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert abs(train[0]["loss"] - math.log(VOCAB)) < 1e-4  # zero head => uniform logits: the import was used
    assert train[-1]["step"] == 6 and train[-1]["loss"] < train[0]["loss"]
    ckpt = fsdp_run / "checkpoints" / "step-00000006"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert len(read_metadata_safely(ckpt).state_dict_metadata["model.layers.0.attention.wq.weight"].chunks) == 2


@pytest.mark.timeout(500)
def test_trained_model_matches_transformers_logits_and_greedy_tokens(fsdp_run, exported, data_cache):
    assert sorted(p.name for p in exported.iterdir()) == [
        "config.json",
        "generation_config.json",
        "lmforge_export.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    cfg, state = load_full_model_state(fsdp_run / "checkpoints" / "step-00000006")
    ours = GPT(cfg)
    ours.init_weights(0)
    ours.load_state_dict(state)
    ours.eval()
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    our_tok = load_tokenizer("embedded", data_cache)

    text = real_text()
    ids = our_tok.encode(text)[:64]
    assert len(ids) == 64 and hf_tok(text)["input_ids"][:64] == ids  # the exported tokenizer is the run's
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = ours(x), theirs(x).logits
    assert a.shape == b.shape == (1, 64, VOCAB) and a.abs().max() > 0.1
    assert (a - b).abs().max().item() < 1e-4

    prompt = ids[:24]
    mine = generate(ours, [prompt], 20, eos_token_id=our_tok.eod, use_cache=False)[0]
    # `lmforge generate`'s loader on the FSDP2-sharded checkpoint, KV-cached: the same tokens.
    loaded = load_for_generation(fsdp_run)
    assert loaded.tokenizer.fingerprint == our_tok.fingerprint
    assert generate(loaded.model, [prompt], 20, eos_token_id=loaded.tokenizer.eod)[0] == mine
    hf_out = theirs.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=20,
        do_sample=False,
    )
    assert hf_out[0, len(prompt) :].tolist() == mine
    assert len(mine) == 20, f"generation stopped early at EOD: {mine}"
    config = json.loads((exported / "config.json").read_text())
    assert config["eos_token_id"] == our_tok.eod and config["num_key_value_heads"] == 2


@pytest.mark.timeout(500)
def test_fsdp2_export_equals_single_process_export_and_round_trips(exported, work):
    """Import the export (a one-process checkpoint of the same weights) and export it again: bit-identical."""
    single = work / "single"
    assert lmforge_main(["import", "hf", str(exported), "--out", str(single), "--name", "again"]) == 0
    metadata = read_metadata_safely(single / "checkpoints" / "step-00000000").state_dict_metadata
    assert len(metadata["model.layers.0.attention.wq.weight"].chunks) == 1
    again = work / "again-hf"
    assert lmforge_main(["export", "hf", str(single), str(again)]) == 0
    from safetensors.torch import load_file

    a, b = load_file(str(exported / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert set(a) == set(b) and len(a) == 2 + 4 * 9 + 1
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert json.loads((again / "config.json").read_text()) == json.loads((exported / "config.json").read_text())
    assert (again / "tokenizer.json").read_bytes() == (exported / "tokenizer.json").read_bytes()
