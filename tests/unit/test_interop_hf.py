"""HF interop in one process: every supported architecture against `transformers`, import checks, safe metadata.

Weights here are random but far from the init (norm gains and biases too), so a wrong name, a swapped
gate/up projection, a wrong kv-head grouping or a rotary permutation shows up as a large logit error.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import transformers
from file_modes_check import umask, wrong_modes

from lmforge.checkpoint.manager import CheckpointManager  # noqa: E402
from lmforge.checkpoint.weights import (
    UnsafeCheckpointError,
    load_full_model_state,
    load_model_weights,  # noqa: E402
    read_metadata_safely,
)
from lmforge.config.checkpoint import CheckpointConfig  # noqa: E402
from lmforge.config.errors import ConfigError  # noqa: E402
from lmforge.config.model import ModelConfig, MoEConfig  # noqa: E402
from lmforge.interop.errors import InteropError  # noqa: E402
from lmforge.interop.export import export_hf  # noqa: E402
from lmforge.interop.importer import import_hf  # noqa: E402
from lmforge.model.gpt import GPT  # noqa: E402
from lmforge.model.moe import is_moe_layer  # noqa: E402

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
    "want of a wife. However little known the feelings or views of such a man may be on his first entering"
)


def small(**kw) -> ModelConfig:
    base = dict(
        name="t",
        vocab_size=512,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        seq_len=64,
        mlp="swiglu",
        norm="rmsnorm",
        tie_embeddings=False,
        rope_theta=5000.0,
        norm_eps=1e-6,
    )
    base.update(kw)
    return ModelConfig(**base)


def random_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    model = GPT(cfg)
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return model.eval()


def save_checkpoint(model: GPT, root: Path) -> Path:
    sidecar = {"config": {"model": asdict(model.cfg), "data": {"tokenizer": "embedded"}}, "world_size": 1}
    return CheckpointManager(root / "checkpoints", CheckpointConfig()).save(3, model, None, sidecar).path


def tokens(vocab: int) -> torch.Tensor:
    return torch.tensor([[b % vocab for b in TEXT.encode()][:48]])


def hf_logits(out_dir: Path, ids: torch.Tensor):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model, model(ids).logits


ARCHS = {
    "gqa-untied": (small(), "LlamaForCausalLM"),
    "mha-tied": (small(n_kv_heads=None, tie_embeddings=True), "LlamaForCausalLM"),
    "mqa-tied": (small(n_kv_heads=1, tie_embeddings=True), "LlamaForCausalLM"),
    "layernorm-gqa": (small(norm="layernorm", norm_eps=1e-5), "StableLmForCausalLM"),
    # MoE (interop/moe_mapping.py): every layer top-2 renormalised -> Mixtral; a dense layer, shared experts and
    # un-normalised gates -> Qwen2-MoE (its zero shared-expert gate and doubled down_proj)
    "moe-mixtral": (small(tie_embeddings=True, moe=MoEConfig(experts=4, top_k=2, d_ff=48)), "MixtralForCausalLM"),
    "moe-qwen2": (
        small(moe=MoEConfig(experts=4, top_k=2, d_ff=32, shared_experts=2, layers=[1], normalize_weights=False)),
        "Qwen2MoeForCausalLM",
    ),
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_export_matches_transformers(arch, tmp_path):
    cfg, hf_class = ARCHS[arch]
    model = random_model(cfg)
    ckpt = save_checkpoint(model, tmp_path / "run")
    res = export_hf(tmp_path / "run", tmp_path / "hf", with_tokenizer=False)
    assert res.checkpoint == ckpt and res.architecture == hf_class
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["num_key_value_heads"] == (cfg.n_kv_heads or cfg.n_heads)
    assert hf_config["tie_word_embeddings"] is cfg.tie_embeddings
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as fh:
        assert ("lm_head.weight" in fh.keys()) is (not cfg.tie_embeddings)
    ids = tokens(cfg.vocab_size)
    hf, theirs = hf_logits(tmp_path / "hf", ids)
    assert type(hf).__name__ == hf_class
    if cfg.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        ours = model(ids)
    assert ours.abs().max() > 1.0  # non-trivial logits
    assert (ours - theirs).abs().max().item() < 1e-4


def test_rotary_needs_no_qk_permutation(tmp_path):
    """Meta's interleaved->half permutation (what HF's Llama converter applies) must NOT be applied here."""
    cfg = small()
    model = random_model(cfg, seed=1)
    save_checkpoint(model, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "hf", with_tokenizer=False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    hd = cfg.d_model // cfg.n_heads

    def permute(w):  # as in convert_llama_weights_to_hf: (heads, hd/2, 2, d) -> (heads, 2, hd/2, d)
        return w.view(-1, hd // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)

    for name in list(tensors):
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[name] = permute(tensors[name]).contiguous()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    ids = tokens(cfg.vocab_size)
    _, theirs = hf_logits(tmp_path / "hf", ids)
    with torch.no_grad():
        ours = model(ids)
    assert (ours - theirs).abs().max().item() > 1e-2  # permuting breaks parity: the identity mapping is the right one


def test_gelu_model_is_refused_by_the_cli(tmp_path, capsys):
    from lmforge.cli import main

    save_checkpoint(random_model(small(mlp="gelu")), tmp_path / "run")
    assert main(["export", "hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "model.mlp='gelu'" in err and "no exact Hugging Face equivalent" in err and "Fix:" in err
    assert not (tmp_path / "hf").exists()


def write_hf_llama(path: Path, tie: bool, shard: str = "5GB") -> transformers.PreTrainedModel:
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path), max_shard_size=shard)
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_import_from_transformers_then_export_round_trips_exactly(tie, tmp_path):
    hf_model = write_hf_llama(tmp_path / "src", tie, shard="60KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").exists()  # a sharded source
    res = import_hf(tmp_path / "src", tmp_path / "imported", name="small")
    assert res.model.tie_embeddings is tie and res.model.n_kv_heads == 2 and res.model.d_ff == 160
    assert res.model.rope_theta == 20000.0 and res.model.norm_eps == 1e-6
    assert "train:\n  init_from: " + str(res.checkpoint) in res.exp_file.read_text()

    cfg, state = load_full_model_state(res.checkpoint)
    ours = GPT(cfg)
    ours.init_weights(0)
    ours.load_state_dict(state)
    ids = tokens(512)
    with torch.no_grad():
        assert (ours.eval()(ids) - hf_model(ids).logits).abs().max().item() < 1e-4

    export_hf(tmp_path / "imported", tmp_path / "back", with_tokenizer=False, max_shard_size="60KB")
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    from safetensors import safe_open

    back = {}
    for f in set(index["weight_map"].values()):
        with safe_open(str(tmp_path / "back" / f), framework="pt") as fh:
            back.update({k: fh.get_tensor(k) for k in fh.keys()})
    original = {k: v for k, v in hf_model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert set(back) == set(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    reloaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert reloaded.config.tie_word_embeddings is tie


def test_import_names_the_offending_tensors(tmp_path):
    write_hf_llama(tmp_path / "src", tie=False)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "src" / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InteropError) as e:
        import_hf(tmp_path / "src", tmp_path / "out")
    msg = str(e.value)
    assert "missing tensor model.layers.1.self_attn.k_proj.weight (32, 64)" in msg
    assert "tensor model.layers.0.mlp.up_proj.weight has shape (100, 64), config.json implies (160, 64)" in msg
    assert "unexpected tensor model.layers.0.self_attn.q_proj.bias (64,)" in msg
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize(
    "key,value,expect",
    [
        ("hidden_act", "gelu", "'hidden_act'='gelu'"),
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}, "rope_type 'llama3'"),
        ("attention_bias", True, "'attention_bias'=True"),
        ("model_type", "gpt2", "'model_type'='gpt2'"),
    ],
)
def test_import_refuses_unrepresentable_architectures(tmp_path, key, value, expect):
    write_hf_llama(tmp_path / "src", tie=False)
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InteropError, match="Fix:") as e:
        import_hf(tmp_path / "src", tmp_path / "out")
    assert expect in str(e.value)


def test_import_is_local_only_and_never_unpickles(tmp_path):
    with pytest.raises(InteropError, match="never downloads"):
        import_hf(Path("meta-llama/Llama-3.2-1B"), tmp_path / "out")
    src = tmp_path / "bin"
    src.mkdir()
    write_hf_llama(tmp_path / "src", tie=False)
    (src / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    (src / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(InteropError, match="pickled weights are not loaded"):
        import_hf(src, tmp_path / "out")


def test_dcp_metadata_is_read_without_arbitrary_unpickling(tmp_path):
    ckpt = save_checkpoint(random_model(small()), tmp_path / "run")
    names = set(read_metadata_safely(ckpt).state_dict_metadata)
    assert "model.layers.1.attention.wk.weight" in names

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafeCheckpointError, match="builtins.print"):
        export_hf(tmp_path / "run", tmp_path / "hf", with_tokenizer=False)


def test_init_from_a_different_shape_names_the_keys(tmp_path):
    ckpt = save_checkpoint(random_model(small()), tmp_path / "run")
    other = GPT(small(d_model=32, n_kv_heads=4))
    with pytest.raises(ConfigError) as e:
        load_model_weights(ckpt, other, other.cfg)
    msg = str(e.value)
    assert msg.startswith("config key 'train.init_from'")
    assert "model.d_model: checkpoint 64, this run 32" in msg and "model.n_kv_heads: checkpoint 2, this run 4" in msg
    same = GPT(small())
    load_model_weights(tmp_path / "run", same, same.cfg)  # a run directory resolves to its newest checkpoint
    _, state = load_full_model_state(ckpt)
    for name, tensor in same.state_dict().items():
        assert torch.equal(tensor, state[name]), name


def test_tokenizer_is_exported_only_if_it_is_the_runs(tmp_path):
    from lmforge.data.tokenizer import load_tokenizer, train_bpe

    tok_path = train_bpe([TEXT * 20, "Emma Woodhouse, handsome, clever, and rich"], 300, tmp_path / "tok.json")
    tok = load_tokenizer(str(tok_path))
    model = random_model(small(vocab_size=300))
    sidecar = {
        "config": {"model": asdict(model.cfg), "data": {"tokenizer": str(tok_path)}},
        "world_size": 1,
        "tokenizer": tok.identity,
    }
    CheckpointManager(tmp_path / "run" / "checkpoints", CheckpointConfig()).save(1, model, None, sidecar)
    with umask(0o002):  # a group-writable umask: the export's modes are set, not inherited
        export_hf(tmp_path / "run", tmp_path / "hf")
    assert {p.name for p in (tmp_path / "hf").iterdir()} >= {"model.safetensors", "tokenizer.json", "config.json"}
    assert wrong_modes(tmp_path / "hf") == []  # every file 0o640 (safetensors writes 0o600), the folder 0o750
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf_tok(TEXT)["input_ids"] == tok.encode(TEXT)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == tok.eod

    sidecar["tokenizer"] = {**tok.identity, "fingerprint": "0123456789abcdef"}
    CheckpointManager(tmp_path / "other" / "checkpoints", CheckpointConfig()).save(1, model, None, sidecar)
    with pytest.raises(InteropError, match="is not the one the run trained with"):
        export_hf(tmp_path / "other", tmp_path / "hf2")


def _safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("arch", ["moe-mixtral", "moe-qwen2"])
def test_moe_export_import_round_trips_exactly(arch, tmp_path):
    """lmforge MoE -> HF -> lmforge gives back every tensor bit for bit (experts re-stacked, the Qwen2-MoE shared
    down_proj halved again), and the imported config is the original model's."""
    cfg, _ = ARCHS[arch]
    model = random_model(cfg, seed=2)
    save_checkpoint(model, tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "hf", with_tokenizer=False)
    res = import_hf(tmp_path / "hf", tmp_path / "imported", name="moe")
    assert (res.model.moe.experts, res.model.moe.top_k, res.model.moe.d_ff, res.model.moe.shared_experts) == (
        cfg.moe.experts,
        cfg.moe.top_k,
        cfg.moe.d_ff,
        cfg.moe.shared_experts,
    )
    assert res.model.moe.normalize_weights is cfg.moe.normalize_weights
    assert [i for i in range(cfg.n_layers) if is_moe_layer(res.model, i)] == [
        i for i in range(cfg.n_layers) if is_moe_layer(cfg, i)
    ]
    _, state = load_full_model_state(res.checkpoint)
    original = model.state_dict()
    assert set(state) == set(original)
    for name, tensor in original.items():
        assert torch.equal(state[name], tensor), name


def test_moe_export_negative_control_and_refusals(tmp_path, capsys):
    """Swapping two experts' weights (router untouched) breaks the logits: the 1e-4 check sees misrouting. A
    non-zero aux-loss-free bias and sigmoid gating are refused in one line (exit 2, nothing written); a capacity
    factor is announced."""
    from lmforge.cli import main

    cfg, _ = ARCHS["moe-mixtral"]
    model = random_model(cfg, seed=3)
    save_checkpoint(model, tmp_path / "run")
    res = export_hf(tmp_path / "run", tmp_path / "hf", with_tokenizer=False)
    assert not any("capacity" in n for n in res.notes)  # dropless: nothing to announce
    from safetensors.torch import save_file

    tensors = _safetensors(tmp_path / "hf")
    pre = "model.layers.0.block_sparse_moe.experts."
    for w in ("w1", "w2", "w3"):
        tensors[f"{pre}0.{w}.weight"], tensors[f"{pre}1.{w}.weight"] = (
            tensors[f"{pre}1.{w}.weight"],
            tensors[f"{pre}0.{w}.weight"],
        )
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    ids = tokens(cfg.vocab_size)
    _, theirs = hf_logits(tmp_path / "hf", ids)
    with torch.no_grad():
        assert (model(ids) - theirs).abs().max().item() > 1e-2

    with torch.no_grad():
        model.layers["1"].feed_forward.router.expert_bias[2] = 0.05
    save_checkpoint(model, tmp_path / "biased")
    capsys.readouterr()  # transformers' loading progress above
    assert main(["export", "hf", str(tmp_path / "biased"), str(tmp_path / "out"), "--no-tokenizer"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layers.1.feed_forward.router.expert_bias is non-zero" in err
    assert "model.moe.bias_update_rate" in err and "Fix:" in err and not (tmp_path / "out").exists()

    save_checkpoint(random_model(small(moe=MoEConfig(experts=4, gating="sigmoid"))), tmp_path / "sigmoid")
    assert main(["export", "hf", str(tmp_path / "sigmoid"), str(tmp_path / "out"), "--no-tokenizer"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.moe.gating='sigmoid'" in err and "Fix:" in err

    save_checkpoint(random_model(small(moe=MoEConfig(experts=4, capacity_factor=1.25))), tmp_path / "capped")
    notes = export_hf(tmp_path / "capped", tmp_path / "capped_hf", with_tokenizer=False).notes
    assert any("model.moe.capacity_factor=1.25: the Hugging Face model is dropless" in n for n in notes)


def test_import_mixtral_and_qwen2_moe_from_transformers(tmp_path):
    """Checkpoints transformers wrote itself import with equal logits and export back tensor for tensor; a
    Qwen2-MoE whose shared-expert gate is not zero is refused, naming the tensor."""
    common = dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
    )
    configs = {
        "mixtral": transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, **common),
        "qwen": transformers.Qwen2MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            shared_expert_intermediate_size=32,
            qkv_bias=False,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            **common,
        ),
    }
    ids = tokens(512)
    for name, hf_cfg in configs.items():
        torch.manual_seed(0)
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
        with torch.no_grad():
            for pname, p in hf_model.named_parameters():
                p.add_(0.1 * torch.randn_like(p)) if "shared_expert_gate" not in pname else p.zero_()
        hf_model.save_pretrained(str(tmp_path / name))
        res = import_hf(tmp_path / name, tmp_path / f"{name}_in", name=name)
        cfg, state = load_full_model_state(res.checkpoint)
        ours = GPT(cfg)
        ours.load_state_dict(state)
        with torch.no_grad():
            assert (ours.eval()(ids) - hf_model(ids).logits).abs().max().item() < 1e-4, name
        export_hf(tmp_path / f"{name}_in", tmp_path / f"{name}_back", with_tokenizer=False)
        back, original = _safetensors(tmp_path / f"{name}_back"), _safetensors(tmp_path / name)
        assert set(back) == set(original)
        for k, t in original.items():
            assert torch.equal(back[k], t), k

    tensors = _safetensors(tmp_path / "qwen")
    tensors["model.layers.1.mlp.shared_expert_gate.weight"][0, 3] = 0.5
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "qwen" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InteropError, match=r"model\.layers\.1\.mlp\.shared_expert_gate\.weight is non-zero"):
        import_hf(tmp_path / "qwen", tmp_path / "qwen_refused", name="q")


def test_import_prints_overrides_a_shell_and_hydra_read_back_as_the_same_model(tmp_path, capsys):
    """The second command `lmforge import hf` prints, pasted into a shell (shlex.split) and composed by Hydra as
    `lmforge train` composes, validates to the imported model config: MoE keys, a layer list, a path with a
    space and an '=' included."""
    import shlex
    from dataclasses import replace

    from lmforge.cli import main
    from lmforge.config.compose import compose
    from lmforge.config.validate import validate

    cfg = replace(ARCHS["moe-qwen2"][0], vocab_size=8192)  # the default tokenizer's vocabulary fits
    save_checkpoint(random_model(cfg, seed=2), tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "hf", with_tokenizer=False)
    out = tmp_path / "imported it" / "a=b"
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(out), "--name", "qwen"]) == 0
    lines = capsys.readouterr().out.splitlines()
    prefix = "or, with the default config tree: lmforge train "
    (line,) = [x for x in lines if x.startswith(prefix)]
    args = shlex.split(line[len(prefix) :])
    assert "model.moe.layers=[1]" in args and "model.moe.experts=4" in args and "model.n_kv_heads=2" in args
    assert f"train.init_from='{out}/checkpoints/step-00000000'" in args  # quoted for Hydra: the '='
    assert not any("{" in a for a in args)  # no Python dict
    composed = compose(args + [f"run.root={tmp_path}"])
    typed = validate(composed, world_size=1).cfg
    imported, _ = load_full_model_state(out / "checkpoints" / "step-00000000")  # the model config it saved
    assert typed.model == imported and typed.model.moe.layers == [1] and typed.model.moe.experts == 4
    assert typed.train.init_from == f"{out}/checkpoints/step-00000000"
    # negative control: the model printed as one Python dict, as plain str() gives, is no Hydra override
    with pytest.raises(ConfigError):
        compose([f"model.moe={asdict(cfg.moe)}"])


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_mup_export_folds_its_multipliers_into_the_weights(norm, tmp_path):
    """µP's logit multiplier 1/m goes into lm_head, its attention scale (sqrt(base/heads)/head_dim instead of
    1/sqrt(head_dim)) into q_proj (RoPE is linear in q): the plain HF class gives the same logits within 1e-5.
    Negative control: the same weights exported as SP (nothing folded) give other logits."""
    cfg = small(norm=norm, parametrization="mup", mup_base_width=16)  # m = 4, head_dim 16, base head dim 4
    model = random_model(cfg)
    save_checkpoint(model, tmp_path / "run")
    notes = export_hf(tmp_path / "run", tmp_path / "hf", with_tokenizer=False).notes
    assert "muP multipliers folded into the weights: q_proj x 0.5 (attention scale), lm_head x 0.25" in notes[-1]
    ids = tokens(cfg.vocab_size)
    _, theirs = hf_logits(tmp_path / "hf", ids)
    with torch.no_grad():
        ours = model(ids)
    assert ours.abs().max() > 0.5
    assert (ours - theirs).abs().max().item() < 1e-5
    save_checkpoint(random_model(replace(cfg, parametrization="sp")), tmp_path / "sp")
    export_hf(tmp_path / "sp", tmp_path / "hf-sp", with_tokenizer=False)
    _, unfolded = hf_logits(tmp_path / "hf-sp", ids)
    assert (ours - unfolded).abs().max().item() > 1e-2


def test_mup_with_tied_embeddings_is_refused_by_the_export():
    from lmforge.interop.mup_fold import fold_mup_multipliers

    with pytest.raises(InteropError, match="model.parametrization=mup with tied embeddings.*Fix: train with"):
        fold_mup_multipliers(small(parametrization="mup", tie_embeddings=True), {})
