"""Generation (lmforge.generation) on tiny random models, one process:

* decode parity: KV-cached greedy == uncached recomputation == `transformers` `generate` on the HF export, for
  MHA, GQA and MQA; a ragged batch (left-padded) == each prompt alone, also with rows stopping early;
* KV-cache bytes: the allocated tensors equal 2 * layers * tokens * kv_heads * head_dim * bytes, for tiny on CPU
  and for the MHA / GQA / MQA variants of the gpt_1b and gpt_7b presets on the meta device;
* negative controls: a cache with wrong positions decodes other tokens; another seed samples other tokens;
* sampling is reproducible by seed; top-k = 1 and a tiny top-p are greedy; stop sequences and EOS end a row.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from test_interop_hf import random_model, save_checkpoint, small

from lmforge.config.model import ModelConfig
from lmforge.generation import GenerationError, KVCache, generate, kv_cache_bytes
from lmforge.generation.sampling import filter_logits
from lmforge.interop.export import export_hf

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 200, 3, 99, 41, 7], [300, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [77]]
ATTENTION = {"mha": None, "gqa": 2, "mqa": 1}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("kind", list(ATTENTION))
def test_cached_greedy_equals_uncached_and_transformers(kind, tmp_path):
    import transformers

    model = random_model(small(n_kv_heads=ATTENTION[kind]), seed=3)
    cached = generate(model, PROMPTS, 12)
    assert cached == generate(model, PROMPTS, 12, use_cache=False)
    assert cached == [generate(model, [p], 12)[0] for p in PROMPTS]  # ragged batch == one by one
    assert len({tuple(c) for c in cached}) == len(PROMPTS) and all(len(c) == 12 for c in cached)

    save_checkpoint(model, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "hf", with_tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert hf.config.num_key_value_heads == (ATTENTION[kind] or 4)
    # One left-padded batch through transformers (positions from its attention mask) against ours.
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[:, width:].tolist() == cached


def test_cache_with_wrong_positions_decodes_differently():
    """Negative control: decode steps at a wrong absolute position (the prompt's start; a uniform shift would not
    do: RoPE scores depend on relative positions only) must change the tokens."""
    model = random_model(small(), seed=3)
    right = generate(model, PROMPTS[:1], 12)
    original = KVCache.positions
    try:
        KVCache.positions = lambda self, start, end: original(self, start, end) * (start == 0)
        wrong = generate(model, PROMPTS[:1], 12)
    finally:
        KVCache.positions = original
    assert wrong != right


def test_cache_bytes_are_the_allocated_tensors():
    cfg = ModelConfig(**yaml.safe_load((REPO / "conf" / "model" / "tiny.yaml").read_text()))
    cache = KVCache(cfg, batch=3, tokens=40)
    tensors = list(cache.keys.values()) + list(cache.values.values())
    assert len(tensors) == 2 * cfg.n_layers
    assert all(t.shape == (3, 2, 40, 16) and t.device.type == "cpu" for t in tensors)
    allocated = sum(t.untyped_storage().nbytes() for t in tensors)
    assert allocated == cache.nbytes() == kv_cache_bytes(cfg, 3, 40) == 2 * 4 * 3 * 40 * 2 * 16 * 4
    assert KVCache(cfg, 3, 40, torch.bfloat16).nbytes() == allocated // 2


@pytest.mark.parametrize("preset", ["gpt_1b", "gpt_7b"])
def test_cache_bytes_of_presets_mha_gqa_mqa(preset):
    cfg = ModelConfig(**yaml.safe_load((REPO / "conf" / "model" / f"{preset}.yaml").read_text()))
    hd = cfg.d_model // cfg.n_heads
    sizes = {}
    for kind, kv in {"mha": cfg.n_heads, "gqa": 8, "mqa": 1}.items():
        c = dataclasses.replace(cfg, n_kv_heads=kv)
        cache = KVCache(c, batch=1, tokens=c.seq_len, dtype=torch.bfloat16, device="meta")
        assert all(t.shape == (1, kv, c.seq_len, hd) for t in cache.keys.values())
        sizes[kind] = sum(t.numel() * t.element_size() for d in (cache.keys, cache.values) for t in d.values())
        assert (
            sizes[kind] == kv_cache_bytes(c, 1, c.seq_len, torch.bfloat16) == 2 * c.n_layers * c.seq_len * kv * hd * 2
        )
    assert sizes["mha"] == sizes["gqa"] * cfg.n_heads // 8 == sizes["mqa"] * cfg.n_heads
    if preset == "gpt_7b":  # Llama-2-7B at 4096 tokens in bf16: 2 GiB of K/V per sequence
        assert sizes["mha"] == 2 * 1024**3


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = random_model(small(), seed=3)
    kw = dict(temperature=1.0, top_k=50, top_p=0.95)
    a = generate(model, PROMPTS, 12, seed=7, **kw)
    assert a == generate(model, PROMPTS, 12, seed=7, **kw)
    assert a != generate(model, PROMPTS, 12, seed=8, **kw)  # negative control: another seed, other tokens
    greedy = generate(model, PROMPTS, 12)
    assert a != greedy
    assert generate(model, PROMPTS, 12, temperature=2.0, top_k=1, seed=1) == greedy
    assert generate(model, PROMPTS, 12, temperature=2.0, top_p=1e-6, seed=1) == greedy


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: torch.isfinite(filter_logits(logits, None, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.8) == [True, True, False, False]
    assert kept(0.81) == [True, True, True, False]
    assert torch.isfinite(filter_logits(logits, 3, None)).sum() == 3


def test_stop_sequences_and_eos_end_rows_and_the_rest_continue():
    model = random_model(small(), seed=3)
    full = generate(model, PROMPTS, 12)
    stop = full[0][3:5]  # the first row completes this pair at new token 5
    eos = full[2][6]
    assert eos not in full[2][:6]
    out = generate(model, PROMPTS, 12, stop=[stop], eos_token_id=eos)
    expect = []
    for row in full:
        n = next((i + 1 for i in range(len(row)) if row[i] == eos or row[max(0, i - 1) : i + 1] == stop), 12)
        expect.append(row[:n])
    assert out[0] == full[0][:5] and out[2] == full[2][:7] and out == expect
    assert out == [generate(model, [p], 12, stop=[stop], eos_token_id=eos)[0] for p in PROMPTS]
    assert generate(model, PROMPTS, 12, stop_when=lambda row: len(row) == 3) == [r[:3] for r in full]


def test_bad_input_is_refused_with_the_fix():
    model = random_model(small(), seed=3)
    with pytest.raises(GenerationError, match=r"prompt 1 \(60 tokens\) \+ max_new_tokens 8 exceeds .*seq_len=64.*Fix"):
        generate(model, [[1], [2] * 60], 8)
    with pytest.raises(GenerationError, match="outside \\[0, 512\\)"):
        generate(model, [[1, 512]], 2)
    with pytest.raises(GenerationError, match="temperature -1"):
        generate(model, [[1]], 2, temperature=-1)
    with pytest.raises(GenerationError, match="top_p 0"):
        generate(model, [[1]], 2, temperature=1, top_p=0)
    with pytest.raises(GenerationError, match="top_k 0: must be >= 1"):
        generate(model, [[1]], 2, temperature=1, top_k=0)
    with pytest.raises(GenerationError, match="prompt 0 is empty"):
        generate(model, [[]], 2)
