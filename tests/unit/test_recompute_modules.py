"""Recompute choices beside none/selective/full: the parts of a block (activation_checkpointing=modules with
recompute_modules) and the first k blocks of each pipeline stage (recompute_layers).

The bytes a block saves for backward are counted with ``saved_tensors_hooks`` (storages de-duplicated) on a real
fp32 CPU block: each part recomputed drops exactly the tensors it owns, and the gradients are bit-identical to no
recompute. The refusals of settings that would be silently ignored are checked by their exact lines."""

from __future__ import annotations

import pytest
import torch

from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.model import ModelConfig
from lmforge.config.validate import validate
from lmforge.model.feed_forward import ffn_hidden_dim
from lmforge.model.gpt import GPT
from lmforge.model.init import canonical_name
from lmforge.parallel.activation_checkpoint import apply_activation_checkpointing, chosen_blocks

CFG = ModelConfig(name="recompute", vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=32)
BATCH = 2


def saved_bytes_and_grads(mode: str, modules=("attention_core",), first_k: int = 0):
    """Activation bytes saved for backward by a forward of ``CFG`` (token ids to loss; parameters left out), and
    the parameter gradients."""
    torch.manual_seed(0)
    model = GPT(CFG)
    model.init_weights(0)
    wrapped = apply_activation_checkpointing(model, mode, modules=modules, first_k=first_k)
    tokens = torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len), generator=torch.Generator().manual_seed(1))
    storages, weights = {}, {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:  # activations only: a recomputed part saves no weights either
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    grads = {canonical_name(n): p.grad.clone() for n, p in model.named_parameters()}
    return sum(storages.values()), grads, wrapped


@pytest.fixture(scope="module")
def baseline():
    return saved_bytes_and_grads("none")


def test_each_recomputed_part_drops_exactly_its_own_saved_tensors_and_keeps_the_gradients(baseline):
    none_bytes, none_grads, _ = baseline
    n, layers, f = BATCH * CFG.seq_len, CFG.n_layers, ffn_hidden_dim(CFG)
    # The SwiGLU MLP keeps w1's and w3's outputs, silu's output and their product (4 x N x F fp32); recomputed,
    # only its input is saved, which the norm's output shares.
    mlp_bytes, mlp_grads, _ = saved_bytes_and_grads("modules", ["mlp"])
    assert none_bytes - mlp_bytes == layers * 4 * n * f * 4
    # The fused attention kernel keeps q, k, v, its output and the fp32 log-sum-exp [B, H, T]. Recomputed, q, k, v
    # stay saved (its inputs) and so does the output (it is wo's input, the same storage): the log-sum-exp goes.
    core_bytes, core_grads, _ = saved_bytes_and_grads("modules", ["attention_core"])
    assert none_bytes - core_bytes == layers * n * CFG.n_heads * 4
    # Each norm keeps at least x * rstd beside its input; recomputed, only the input.
    norm_bytes, norm_grads, _ = saved_bytes_and_grads("modules", ["norms"])
    assert none_bytes - norm_bytes >= layers * 2 * n * CFG.d_model * 4
    all_bytes, all_grads, wrapped = saved_bytes_and_grads("modules", ["attention_core", "mlp", "norms"])
    assert none_bytes - all_bytes == (none_bytes - mlp_bytes) + (none_bytes - core_bytes) + (none_bytes - norm_bytes)
    assert wrapped == ["0", "1", "2", "3"]
    for grads in (mlp_grads, core_grads, norm_grads, all_grads):
        assert grads.keys() == none_grads.keys()
        assert all(torch.equal(grads[k], none_grads[k]) for k in grads)


def test_recompute_layers_checkpoints_the_first_k_blocks_of_each_stage(baseline):
    none_bytes, none_grads, _ = baseline
    full_bytes, _, _ = saved_bytes_and_grads("full")
    one_bytes, one_grads, wrapped = saved_bytes_and_grads("full", first_k=1)
    assert wrapped == ["0"]
    # One of four blocks checkpointed: a quarter of the saving of every block.
    assert none_bytes - one_bytes == (none_bytes - full_bytes) // CFG.n_layers
    assert all(torch.equal(one_grads[k], none_grads[k]) for k in none_grads)
    # Per pipeline stage: the first k of each stage's blocks (a rank's stages, in its own order).
    assert chosen_blocks(["0", "1", "4", "5"], [["0", "1"], ["4", "5"]], 1) == ["0", "4"]
    assert chosen_blocks(["0", "1", "4", "5"], [["0", "1"], ["4", "5"]], 0) == ["0", "1", "4", "5"]
    assert chosen_blocks(["0", "1", "2"], None, 5) == ["0", "1", "2"]


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        validate(compose(["model=tiny", *overrides]))
    return str(e.value)


def test_settings_no_mode_reads_are_refused_in_one_line():
    assert refusal("parallelism.recompute_modules=[mlp]") == (
        "config key 'parallelism.recompute_modules': only activation_checkpointing=modules reads it (this run: "
        "none), so it would be silently ignored. Fix: set parallelism.activation_checkpointing=modules, or leave "
        "recompute_modules unset"
    )
    assert refusal("parallelism.activation_checkpointing=modules", "parallelism.recompute_modules=[mlp,attn]") == (
        "config key 'parallelism.recompute_modules': attn is not a part of a block. Fix: name parts from "
        "attention_core, mlp, norms (e.g. parallelism.recompute_modules=[attention_core,mlp])"
    )
    assert "is empty: activation_checkpointing=modules would recompute nothing" in refusal(
        "parallelism.activation_checkpointing=modules", "parallelism.recompute_modules=[]"
    )
    assert refusal("parallelism.recompute_layers=2") == (
        "config key 'parallelism.recompute_layers': recompute_layers=2 picks blocks to checkpoint, but none are. "
        "Fix: set parallelism.activation_checkpointing=full (or selective, modules), or recompute_layers=0"
    )
    assert "document-masked attention runs its own kernel" in refusal(
        "parallelism.activation_checkpointing=modules", "data.document_masking=true"
    )
    # Controls: the settings a mode reads pass.
    validate(
        compose(
            ["model=tiny", "parallelism.activation_checkpointing=modules", "parallelism.recompute_modules=[mlp,norms]"]
        )
    )
    validate(compose(["model=tiny", "parallelism.activation_checkpointing=full", "parallelism.recompute_layers=1"]))


@pytest.mark.parametrize("modules", [["mlp"], ["attention_core"], ["norms"], ["attention_core", "mlp", "norms"]])
def test_the_planner_drops_the_rows_the_measurement_drops(baseline, modules):
    """The planner's table (parallel/activation_table.py, fp32 and the composite RMSNorm as on this CPU): what a
    recomputed part saves less per block equals what the saved-tensor count above measures."""
    from dataclasses import replace

    from lmforge.config.schema import RootConfig
    from lmforge.parallel.memory_estimate import activation_shape, layer_activation_bytes

    measured, _, _ = saved_bytes_and_grads("modules", modules)
    root = RootConfig()
    shape = activation_shape(replace(root, model=CFG), BATCH, "fp32", rms_norm_kernel="composite")
    planned = layer_activation_bytes(CFG, shape, "none") - layer_activation_bytes(CFG, shape, "modules", modules)
    assert (baseline[0] - measured) == CFG.n_layers * planned


def test_the_planner_counts_recompute_layers_per_stage():
    from lmforge.parallel.memory_estimate import checkpointed_blocks

    def blocks(*extra):
        base = ["model=tiny", "model.n_layers=6", "train.micro_batch_size=1", "train.global_batch_size=4"]
        cfg = validate(compose([*base, "parallelism.activation_checkpointing=full", *extra]), world_size=2)
        return [checkpointed_blocks(cfg, r) for r in range(cfg.parallelism.pp)]

    assert blocks("parallelism=pp2", "parallelism.recompute_layers=1") == [1, 1]  # 3 per stage, the first of each
    assert blocks("parallelism=pp2", "parallelism.recompute_layers=2", "parallelism.pp_layers=[1,5]") == [1, 2]
    assert blocks("parallelism=pp2") == [3, 3]  # 0: every block
    assert blocks("parallelism=pp2_interleaved", "parallelism.recompute_layers=1", "model.n_layers=8") == [2, 2]
