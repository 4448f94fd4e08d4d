"""The activation table (parallel/activation_table.py) against the bytes one block really saves for backward.

One ``model.gpt.Block`` is built on the meta device at the shapes of 7B / 70B / 175B-class models and run forward
under ``torch.autograd.graph.saved_tensors_hooks``; every saved tensor's storage is counted once (parameters and
buffers excluded). Tensor parallelism is one rank's local shapes (heads / tp, FFN width / tp) on one process;
sequence parallelism runs the norms on a sequence shard, gathers it before attention / the MLP with
``tensor_parallel.ShardKeeper`` installed (the hooks the SP plan installs) and cuts the outputs back to the shard.

SDPA: on meta, ``F.scaled_dot_product_attention`` dispatches to its math path, which keeps the a x s^2 attention
probabilities -- not what runs on a GPU. The block's kernel hook (``Attention.attend``) is therefore pointed at
``aten._scaled_dot_product_flash_attention``, the kernel CUDA picks for these shapes, whose meta function and
autograd formula are torch's own: it saves q, k, v, the output, the fp32 log-sum-exp and the RNG state. RMSNorm on
meta is the composite kernel (CPU's), counted with the table's ``rms_norm_kernel="composite"`` rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmforge.config.model import ModelConfig
from lmforge.model.gpt import Block, RotaryTables
from lmforge.parallel.activation_table import BlockPrecision, block_saved_tensors, table_bytes
from lmforge.parallel.memory_estimate import ActivationShape, Dtypes, layer_activation_bytes
from lmforge.parallel.tensor_parallel import ShardKeeper

TOLERANCE = 0.02
BF16 = BlockPrecision(residual=2, compute=2)


def model(name: str, d: int, layers: int, heads: int, kv: int, seq: int, mlp: str = "swiglu", norm: str = "rmsnorm"):
    return ModelConfig(
        name=name, vocab_size=32000, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv, seq_len=seq,
        mlp=mlp, norm=norm,
    )  # fmt: skip


LLAMA_7B = model("7b", 4096, 32, 32, 32, 2048)
LLAMA_70B = model("70b", 8192, 80, 64, 8, 4096)
GPT3_175B = model("175b", 12288, 96, 96, 96, 2048, mlp="gelu", norm="layernorm")


def flash_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale=None) -> torch.Tensor:
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, scale=scale)[0]


def tp_local(block: Block, cfg: ModelConfig, tp: int) -> Block:
    """One tp rank's block: column-parallel outputs and row-parallel inputs cut to 1/tp (meta, shapes only)."""
    hd, att, ffn = cfg.d_model // cfg.n_heads, block.attention, block.feed_forward
    d, q, kv, f = cfg.d_model, cfg.n_heads * hd // tp, (cfg.n_kv_heads or cfg.n_heads) * hd // tp, att.wq.out_features
    f = ffn.w1.out_features // tp
    att.wq, att.wk, att.wv, att.wo = (nn.Linear(i, o, bias=False) for i, o in ((d, q), (d, kv), (d, kv), (q, d)))
    ffn.w1, ffn.w2 = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)
    if ffn.w3 is not None:
        ffn.w3 = nn.Linear(d, f, bias=False)
    return block


class SavedStorages:
    """Distinct storages saved for backward, parameters and buffers excluded: ``add`` is a pack hook's body."""

    def __init__(self, own: set):
        self.own, self.seen = own, {}

    def add(self, t: torch.Tensor) -> None:
        key = t.untyped_storage()._cdata
        if key not in self.own:
            self.seen[key] = t.untyped_storage().nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def emulate_sequence_parallel(block: Block, tp: int, counted: SavedStorages, keep_shards: bool) -> None:
    """Norms on the sequence shard; attention / feed_forward get it gathered (t copies: the all-gather's shape)
    and return the shard (the reduce-scatter's). ``keep_shards``: the gathered input is saved through
    ``ShardKeeper`` as the SP plan does (what the graph then holds is the shard the keeper closes over)."""

    def gather(module, inputs):
        shard, *rest = inputs
        gathered = torch.cat([shard] * tp, dim=1)
        if keep_shards:
            keeper = ShardKeeper(gathered, lambda: torch.cat([shard.detach()] * tp, dim=1))

            def pack(t):
                packed = keeper.pack(t)
                counted.add(t if packed is t else shard)
                return packed

            module.hooks = torch.autograd.graph.saved_tensors_hooks(pack, keeper.unpack)
            module.hooks.__enter__()
        return (gathered, *rest)

    def scatter(module, inputs, output):
        if keep_shards:
            module.__dict__.pop("hooks").__exit__(None, None, None)
        return output[:, : output.shape[1] // tp]

    for module in (block.attention, block.feed_forward):
        module.register_forward_pre_hook(gather)
        module.register_forward_hook(scatter)


def saved_bytes(cfg: ModelConfig, *, tp: int = 1, sp: bool = False, keep_shards: bool = True, batch: int = 1) -> int:
    """Bytes of the distinct storages one block saves for backward (meta device, bf16)."""
    with torch.device("meta"):
        block = Block(cfg)
        rope = RotaryTables(cfg)
        if tp > 1:
            tp_local(block, cfg, tp)
    block.attention.attend = flash_attend
    block.to(torch.bfloat16)
    own = {t.untyped_storage()._cdata for t in (*block.parameters(), rope.cos, rope.sin)}
    counted = SavedStorages(own)
    if sp:
        emulate_sequence_parallel(block, tp, counted, keep_shards)
    tokens = cfg.seq_len // tp if sp else cfg.seq_len
    x = torch.empty(batch, tokens, cfg.d_model, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(counted.pack, lambda t: t):
        out = block(x, rope.cos, rope.sin)
    assert out.requires_grad and out.shape == x.shape
    return counted.total


def table(cfg: ModelConfig, *, tp: int = 1, sp: bool = False, linear_inputs: str = "shard", batch: int = 1) -> int:
    rows = block_saved_tensors(cfg, BF16, sp=sp, rms_norm_kernel="composite", linear_inputs=linear_inputs)
    return table_bytes(rows, tokens=batch * cfg.seq_len, positions=cfg.seq_len, tp=tp, sp=sp)


@pytest.fixture(scope="module", autouse=True)
def meta_kernels_loaded():
    """torch loads its meta kernels on the first meta dispatch (seconds, once per process): done on a tiny block."""
    saved_bytes(model("tiny", 64, 1, 2, 2, 16))


CASES = [
    pytest.param(LLAMA_7B, 1, False, id="7b"),
    pytest.param(LLAMA_7B, 8, False, id="7b-tp8"),
    pytest.param(LLAMA_7B, 8, True, id="7b-tp8-sp"),
    pytest.param(LLAMA_70B, 1, False, id="70b-gqa"),
    pytest.param(LLAMA_70B, 8, True, id="70b-gqa-tp8-sp"),
    pytest.param(GPT3_175B, 1, False, id="175b"),
    pytest.param(GPT3_175B, 8, False, id="175b-tp8"),
    pytest.param(GPT3_175B, 8, True, id="175b-tp8-sp"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg, tp, sp", CASES)
def test_table_matches_bytes_saved_by_one_block(cfg, tp, sp):
    measured = saved_bytes(cfg, tp=tp, sp=sp)
    expected = table(cfg, tp=tp, sp=sp)
    assert abs(expected / measured - 1) <= TOLERANCE, f"table {expected} vs saved {measured} bytes"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg", [LLAMA_7B, GPT3_175B], ids=["7b", "175b"])
def test_negative_control_all_gathered_linear_inputs_exceed_the_table(cfg):
    """Without ShardKeeper (a plain all-gather before the linears, the earlier SP layout) each rank keeps the
    gathered norm outputs: the saved bytes match the table's ``gathered`` rows and miss the shard table by far."""
    old = saved_bytes(cfg, tp=8, sp=True, keep_shards=False)
    sharded = table(cfg, tp=8, sp=True)
    assert old / sharded - 1 > 10 * TOLERANCE, f"{old} vs {sharded}"
    assert abs(table(cfg, tp=8, sp=True, linear_inputs="gathered") / old - 1) <= TOLERANCE


def test_korthikanti_32sbh_for_a_gelu_layernorm_mha_block():
    """34*s*b*h bytes less the two s*b*h dropout masks, for the rows that scale with h (the fp32 statistics, SDPA's
    log-sum-exp and the RoPE table casts are the rest); /t with tp and sequence parallelism, 8 + 24/t without."""
    cfg, s, b, t = GPT3_175B, GPT3_175B.seq_len, 2, 8
    h = cfg.d_model
    rows = block_saved_tensors(cfg, BF16)
    small = {"attention_norm.stats", "ffn_norm.stats", "attention.lse", "attention.rope_tables"}
    main = tuple(r for r in rows if r.name not in small)
    assert table_bytes(main, tokens=s * b, positions=s) == 32 * s * b * h
    assert table_bytes(main, tokens=s * b, positions=s, tp=t, sp=True) == 32 * s * b * h // t
    assert table_bytes(main, tokens=s * b, positions=s, tp=t) == 8 * s * b * h + 24 * s * b * h // t
    assert table_bytes(rows, tokens=s * b, positions=s) / (32 * s * b * h) - 1 < 0.005


def test_layer_activation_bytes_counts_the_table_and_the_checkpointed_sets():
    cfg = LLAMA_7B
    dt = Dtypes(param=4, compute=2, residual=2, fsdp_param=2, fsdp_reduce=4)
    shape = ActivationShape(tokens=cfg.seq_len, tp=8, sp=True, dt=dt, positions=cfg.seq_len)
    none = layer_activation_bytes(cfg, shape, "none")
    assert none == table_bytes(
        block_saved_tensors(cfg, BF16, sp=True), tokens=cfg.seq_len, positions=cfg.seq_len, tp=8, sp=True
    )
    assert layer_activation_bytes(cfg, shape, "full") == cfg.seq_len * cfg.d_model * 2 // 8
    # Under sp selective keeps wo's and w2's outputs, the rank's [tokens, d] partial sums before their
    # reduce-scatter: more than the sharded block without checkpointing. Without tp the usual order holds.
    assert layer_activation_bytes(cfg, shape, "selective") > none
    one = ActivationShape(tokens=cfg.seq_len, tp=1, sp=False, dt=dt, positions=cfg.seq_len)
    modes = [layer_activation_bytes(cfg, one, mode) for mode in ("full", "selective", "none")]
    assert modes == sorted(modes) and len(set(modes)) == 3


@pytest.mark.timeout(60)
def test_sequence_parallel_plan_saves_shards_and_regathers_them_in_backward(tmp_path, monkeypatch):
    """The SP block plan on a real (one-rank gloo) tp mesh: the five linears reading gathered inputs (wq, wk, wv,
    w1, w3) save a shard reference, backward gathers each again, and the gradients equal the plain block's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from lmforge.parallel import tensor_parallel

    counts = {"pack": 0, "unpack": 0}
    pack, unpack = ShardKeeper.pack, ShardKeeper.unpack

    def counting_pack(self, t):
        packed = pack(self, t)
        counts["pack"] += packed is not t
        return packed

    def counting_unpack(self, packed):
        counts["unpack"] += isinstance(packed, tensor_parallel._ShardRef)
        return unpack(self, packed)

    monkeypatch.setattr(ShardKeeper, "pack", counting_pack)
    monkeypatch.setattr(ShardKeeper, "unpack", counting_unpack)
    owned = not dist.is_initialized()  # a one-rank group an earlier in-process test left (`pytest --tier all`) serves
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        cfg = model("small", 64, 1, 4, 2, 16)
        torch.manual_seed(0)
        plain = Block(cfg)
        torch.manual_seed(0)
        block = parallelize_module(Block(cfg), mesh, tensor_parallel.block_plan(sequence_parallel=True))
        rope = RotaryTables(cfg)
        x = torch.randn(2, 16, 64, requires_grad=True)
        x_plain = x.detach().clone().requires_grad_()
        out = block(x, rope.cos, rope.sin)  # the residual stream: plain [B, T/tp, d] (here tp = 1)
        out.square().sum().backward()
        plain(x_plain, rope.cos, rope.sin).square().sum().backward()
    finally:
        if owned:
            dist.destroy_process_group()
    assert counts == {"pack": 5, "unpack": 5}
    torch.testing.assert_close(x.grad, x_plain.grad)
    torch.testing.assert_close(block.attention.wq.weight.grad.full_tensor(), plain.attention.wq.weight.grad)
    torch.testing.assert_close(block.feed_forward.w1.weight.grad.full_tensor(), plain.feed_forward.w1.weight.grad)


def float8_block_saved(cfg: ModelConfig, recipe: str, batch: int) -> dict:
    """What one real CPU block with every linear converted to torchao ``Float8Linear`` (``recipe``) saves for
    backward under the fp8 run's bf16 autocast and bf16 residual stream: {storage: bytes}, parameters excluded.
    torchao's float8 casts do not run on the meta device, so the block is tiny and real."""
    from lmforge.config.train import Float8Config
    from lmforge.parallel.float8 import convert_to_float8, float8_modules

    torch.manual_seed(0)
    block, rope = Block(cfg), RotaryTables(cfg)
    names = convert_to_float8(
        block, Float8Config(recipe=recipe, shape_filter=False), device=torch.device("cpu"), compiled=True
    )
    assert len(names) == 7 and len(list(float8_modules(block))) == 7
    own = {t.untyped_storage()._cdata for t in (*block.parameters(), rope.cos, rope.sin)}
    counted = SavedStorages(own)
    x = torch.randn(batch, cfg.seq_len, cfg.d_model).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(counted.pack, lambda t: t):
        out = block(x, rope.cos, rope.sin)
    assert out.requires_grad and out.dtype == torch.bfloat16
    return counted.seen


FP8_BLOCK = model("fp8", 256, 1, 4, 2, 128)


def planned_fp8_rows(precision: str, batch: int) -> dict:
    """The planner's per-tensor rows for one block of ``FP8_BLOCK`` on the CPU (composite RMSNorm): {name: bytes}."""
    from lmforge.config.schema import RootConfig
    from lmforge.config.train import TrainConfig
    from lmforge.parallel.memory_estimate import activation_shape, block_precision

    cfg = RootConfig(model=FP8_BLOCK, train=TrainConfig(precision=precision))
    shape = activation_shape(cfg, batch, precision, rms_norm_kernel="composite")
    rows = block_saved_tensors(FP8_BLOCK, block_precision(shape), rms_norm_kernel="composite")
    tokens = batch * FP8_BLOCK.seq_len
    return {r.name: r.bytes(tokens=tokens, positions=FP8_BLOCK.seq_len, tp=1, sp=False) for r in rows}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_planned_fp8_rows_match_what_a_float8_block_saves(recipe):
    """Every planned row of ``train.precision=fp8`` is one storage torchao's float8 block saves (bf16 linear inputs,
    not float8 ones; the fp32 norm copies and statistics), and the planned block within TOLERANCE of the saved
    bytes. RoPE's per-position table casts (cos and sin, cast once for q and once for k: 4 small storages where the
    table counts 2) are compared in the total only."""
    batch = 2
    saved = float8_block_saved(FP8_BLOCK, recipe, batch)
    planned = planned_fp8_rows("fp8", batch)
    rope_cast = FP8_BLOCK.seq_len * (FP8_BLOCK.d_model // FP8_BLOCK.n_heads) * 2  # one bf16 cos or sin table
    saved_rows = sorted(b for b in saved.values() if b != rope_cast)
    assert saved_rows == sorted(b for name, b in planned.items() if name != "attention.rope_tables")
    total_saved, total_planned = sum(saved.values()), sum(planned.values())
    assert abs(total_planned / total_saved - 1) <= TOLERANCE, f"planned {total_planned} vs saved {total_saved}"


@pytest.mark.timeout(60)
def test_negative_control_fp8_planned_at_fp32_activations_misses_the_saved_bytes():
    """The rows fp8 was planned with before (fp32 activations, as ``train.precision=fp32``) overcount what the
    float8 block saves far beyond TOLERANCE, and their per-tensor sizes differ."""
    saved = float8_block_saved(FP8_BLOCK, "tensorwise", 2)
    fp32_rows = planned_fp8_rows("fp32", 2)
    assert sum(fp32_rows.values()) / sum(saved.values()) - 1 > 10 * TOLERANCE
    assert sorted(fp32_rows.values()) != sorted(saved.values())
