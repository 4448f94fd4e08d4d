"""``lmforge plan``: the exact refusal for each impossible or out-of-memory layout, and the plan's numbers."""

from __future__ import annotations

import json
import math

import pytest

from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate
from lmforge.model.flops import flops_per_token
from lmforge.model.gpt import param_count_from_config
from lmforge.parallel.memory_estimate import GIB, parameter_shapes, state_bytes
from lmforge.parallel.plan_cli import main as plan_main
from lmforge.parallel.plan_cli import plan_from_overrides
from lmforge.parallel.planner import check_fits, make_plan, warn_if_over_memory

G1 = ["+exp=gpt_1b"]
G7 = ["+exp=gpt_7b", "parallelism.tp=1", "parallelism.sequence_parallel=false"]

INVALID = {
    "world_size": (
        G1 + ["cluster.nodes=2", "parallelism.dp_replicate=1"],
        "config key 'parallelism': dp_replicate*dp_shard*tp*pp = 1*8*1*1 = 8 but the job has world size 16. "
        "Fix: make the product equal 16 (e.g. parallelism.dp_shard=16)",
    ),
    "heads_tp": (
        G1 + ["cluster.nodes=2", "parallelism.dp_replicate=1", "parallelism.dp_shard=1", "parallelism.tp=16"],
        "config key 'parallelism.tp': n_heads (16) and n_kv_heads (8) must both be divisible by tp (16). "
        "Fix: choose tp dividing both head counts",
    ),
    "layers_pp": (
        G1
        + [
            "cluster.nodes=2",
            "parallelism.dp_replicate=1",
            "parallelism.dp_shard=1",
            "parallelism.pp=4",
            "parallelism.tp=4",
            "parallelism.pp_virtual_stages=4",
            "parallelism.pp_schedule=Interleaved1F1B",
        ],
        "config key 'parallelism.pp_layers': n_layers (24) is not divisible by pp*pp_virtual_stages (16) and no "
        "stage map is set. Fix: set parallelism.pp_layers=[1,1,1,1,2,2,2,2,2,2,2,2,1,1,1,1] (blocks per pipeline "
        "chunk, fewer on the chunks holding the embedding and the output head), or choose pp and pp_virtual_stages "
        "whose product divides n_layers",
    ),
    "microbatches_pp": (
        G1
        + [
            "cluster.nodes=2",
            "parallelism.dp_replicate=1",
            "parallelism.dp_shard=2",
            "parallelism.pp=8",
            "train.global_batch_size=16",
            "model.tie_embeddings=false",
        ],
        "config key 'parallelism.pp_microbatches': 2 microbatches cannot fill 8 pipeline stages. "
        "Fix: use at least 8 microbatches (raise train.global_batch_size or pp_microbatches)",
    ),
    "batch_arithmetic": (
        G1 + ["cluster.nodes=3"],
        "config key 'train.global_batch_size': 512 is not divisible by micro_batch_size (4) x data-parallel size "
        "(24) = 96. Fix: use a multiple of 96, e.g. train.global_batch_size=480 or 576",
    ),
    "sequence_parallel_without_tp": (
        G1 + ["parallelism.sequence_parallel=true"],
        "config key 'parallelism.sequence_parallel': needs tp > 1. Fix: set parallelism.tp >= 2 or "
        "sequence_parallel=false",
    ),
    "virtual_stages_1f1b": (
        G1 + ["parallelism.dp_shard=4", "parallelism.pp=2", "parallelism.pp_virtual_stages=2"],
        "config key 'parallelism.pp_virtual_stages': 1F1B runs one stage per rank. Fix: use "
        "pp_schedule=Interleaved1F1B (or a zero-bubble schedule) for virtual stages",
    ),
    "unknown_device": (
        G1 + ["cluster.device=tpu"],
        "config key 'cluster.device': no memory size known for device 'tpu'. Fix: set cluster.device_memory_gib, "
        "or one of: a100, a100_40gb, a100_80gb, b200, h100, h100_nvl, h100_pcie, h100_sxm, h200, h200_nvl, l40s, "
        "mi300x, cpu",
    ),
    "assumed_mfu_retired": (
        G1 + ["cluster.assumed_mfu=0.4"],
        "config key 'cluster.assumed_mfu': is retired: the planner predicts step time from per-op GEMM efficiency, "
        "the link table and the schedule (lmforge.parallel.step_model). Fix: remove the override; give a measured "
        "GEMM rate with cluster.gemm_tflops",
    ),
}

OUT_OF_MEMORY = {
    "activations_fix_checkpointing": (
        G1 + ["train.micro_batch_size=16"],
        "config key 'parallelism': estimated 80.8 GiB per device exceeds the 74.0 GiB usable of 80 GiB on h100 "
        "(parameters+gradients+optimizer 2.3 GiB, activations 71.8 GiB). Fix: "
        "parallelism.activation_checkpointing=selective (49.5 GiB) or parallelism.activation_checkpointing=full "
        "(18.4 GiB)",
    ),
    "activations_fix_micro_batch": (
        G1 + ["train.micro_batch_size=96", "train.global_batch_size=1536", "cluster.nodes=2"],
        "config key 'parallelism': estimated 454.9 GiB per device exceeds the 74.0 GiB usable of 80 GiB on h100 "
        "(parameters+gradients+optimizer 2.3 GiB, activations 430.5 GiB). Fix: train.micro_batch_size=48 "
        "parallelism.activation_checkpointing=full (43.1 GiB) or train.micro_batch_size=24 "
        "parallelism.activation_checkpointing=full (24.5 GiB)",
    ),
    "model_state_fix_dp_shard": (
        G7
        + [
            "cluster.nodes=4",
            "parallelism.dp_shard=1",
            "parallelism.dp_replicate=32",
            "parallelism.activation_checkpointing=full",
        ],
        "config key 'parallelism': estimated 115.3 GiB per device exceeds the 74.0 GiB usable of 80 GiB on h100 "
        "(parameters+gradients+optimizer 100.4 GiB, activations 2.1 GiB). Fix: parallelism.dp_shard=32 "
        "parallelism.dp_replicate=1 (23.0 GiB) or parallelism.tp=2 parallelism.dp_replicate=16 (58.3 GiB)",
    ),
    "small_device_fix_tp": (
        G7 + ["cluster.nodes=1", "cluster.device=l40s", "cluster.device_memory_gib=24", "parallelism.dp_shard=8"],
        "config key 'parallelism': estimated 54.5 GiB per device exceeds the 20.8 GiB usable of 24 GiB on l40s "
        "(parameters+gradients+optimizer 12.6 GiB, activations 24.2 GiB). Fix: parallelism.tp=4 "
        "parallelism.dp_shard=2 parallelism.activation_checkpointing=full (18.9 GiB) or parallelism.tp=8 "
        "parallelism.dp_shard=1 parallelism.activation_checkpointing=full (15.6 GiB)",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_layout_exact_message(case):
    overrides, message = INVALID[case]
    with pytest.raises(ConfigError) as err:
        check_fits(plan_from_overrides(overrides))
    assert str(err.value) == message


@pytest.mark.parametrize("case", sorted(OUT_OF_MEMORY))
def test_out_of_memory_layout_refused_with_fix(case):
    overrides, message = OUT_OF_MEMORY[case]
    plan = plan_from_overrides(overrides)
    assert not plan.fits
    with pytest.raises(ConfigError) as err:
        check_fits(plan)
    assert str(err.value) == message


def test_suggested_fixes_really_fit():
    """Applying a suggested fix gives a layout the planner accepts."""
    overrides, _ = OUT_OF_MEMORY["small_device_fix_tp"]
    fixed = plan_from_overrides(
        overrides + ["parallelism.tp=4", "parallelism.dp_shard=2", "parallelism.activation_checkpointing=full"]
    )
    check_fits(fixed)
    assert fixed.fits and fixed.memory.total / GIB == pytest.approx(18.91, abs=0.05)


def test_cli_prints_plan_and_exit_codes(capsys):
    from lmforge.cli import VERBS

    # data.max_epochs=0: the layout alone (the embedded mixture would be refused for gpt_1b, test_data_epochs.py)
    assert VERBS["plan"](G1 + ["cluster.nodes=2", "data.max_epochs=0"]) == 0
    out = capsys.readouterr().out
    assert (
        "mesh       pp=1 x dp_replicate=2 x dp_shard=8 x tp=1  (dp_shard groups within a node; dp_replicate "
        "groups across 2 nodes)"
    ) in out
    assert "1,216,710,656 parameters" in out
    assert "512 sequences = micro 4 x grad_accum 8 x dp 16; 1,048,576 tokens/step" in out
    assert "fits       yes" in out
    for row in ("parameters", "gradients", "optimizer state (AdamW)", "activations", "total"):
        assert f"\n  {row} " in out
    assert "activations by checkpointing: none" in out and "step time" in out

    assert plan_main(["--json"] + G1 + ["cluster.nodes=2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (
        data["mesh"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 8, "tp": 1, "cp": 1, "ep": 1} and data["fits"] is True
    )
    assert data["cp_exchange_bytes_per_step"] == 0
    assert data["memory_total_bytes"] == sum(data["memory_bytes"].values())
    assert set(data["activations_by_mode_bytes"]) == {"none", "selective", "full"}

    assert plan_main(INVALID["world_size"][0]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"lmforge plan: refused: {INVALID['world_size'][1]}"
    assert plan_main(OUT_OF_MEMORY["activations_fix_checkpointing"][0]) == 2
    captured = capsys.readouterr()
    assert "fits       NO" in captured.out
    assert captured.err.strip() == f"lmforge plan: refused: {OUT_OF_MEMORY['activations_fix_checkpointing'][1]}"


def test_plan_numbers_come_from_the_one_flops_formula_and_batch_plan():
    plan = plan_from_overrides(G1 + ["cluster.nodes=4"])
    cfg = plan.cfg
    assert plan.world_size == 32
    assert plan.n_params == param_count_from_config(cfg.model)
    assert plan.flops_per_token == flops_per_token(cfg.model)
    assert plan.flops_per_step == flops_per_token(cfg.model) * 512 * 2048
    # the step is the sum of where its time goes, and no layout beats every FLOP at the sustained GEMM rate
    assert plan.step_time_s == pytest.approx(sum(s for _, s in plan.step.rows()), rel=1e-12)
    rate = plan.device.gemm_rate("bf16")
    assert rate == pytest.approx(989.4e12 * 0.80)
    assert plan.step.compute_s > plan.flops_per_step / plan.world_size / rate
    assert 0 < plan.expected_mfu < 0.80
    # HSDP: the dp_replicate all-reduce crosses nodes, the FSDP group stays in one
    groups = {g.name: g for g in plan.step.groups}
    assert groups["dp_shard"].crosses_nodes is False and groups["dp_replicate"].crosses_nodes is True
    assert plan.step.dp_comm_total_s > plan.step.dp_comm_s > 0  # issued, mostly hidden under backward


BASE = ["model=gpt_1b", "model.tie_embeddings=false", "cluster=h100_node", "train.micro_batch_size=1"]


def test_bubble_and_recompute_stretch_the_step():
    base = BASE + ["train.global_batch_size=16"]
    flat = plan_from_overrides(base + ["parallelism.dp_shard=8"])
    pp = plan_from_overrides(base + ["parallelism.pp=4", "parallelism.dp_shard=2"])
    assert pp.n_micro == 8 and pp.bubble == pytest.approx(3 / 8)
    assert pp.step.pp_bubble_s == pytest.approx(pp.step.compute_s * 3 / 8)
    assert pp.step.pp_comm_s > 0 and flat.step.pp_bubble_s == flat.step.pp_comm_s == 0
    inter = plan_from_overrides(
        base
        + [
            "parallelism.pp=4",
            "parallelism.dp_shard=2",
            "parallelism.pp_virtual_stages=2",
            "parallelism.pp_schedule=Interleaved1F1B",
        ]
    )
    assert inter.bubble == pytest.approx(3 / 16) and inter.step.pp_bubble_s < pp.step.pp_bubble_s
    zb = plan_from_overrides(
        base
        + [
            "parallelism.pp=4",
            "parallelism.dp_shard=2",
            "parallelism.pp_schedule=ZBVZeroBubble",
            "parallelism.pp_virtual_stages=2",
            "parallelism.reshard_after_forward=false",
        ]
    )
    assert zb.bubble == pytest.approx(3 / 8 / 3)
    # full recompute runs every block's forward once more: a third of the blocks' forward + backward, less the head
    full = plan_from_overrides(base + ["parallelism.dp_shard=8", "parallelism.activation_checkpointing=full"])
    assert full.step.compute_s - flat.step.compute_s == pytest.approx(full.step.recompute_s, rel=1e-9)
    assert 0.2 * flat.step.compute_s < full.step.recompute_s < 0.5 * flat.step.compute_s
    selective = plan_from_overrides(base + ["parallelism.dp_shard=8", "parallelism.activation_checkpointing=selective"])
    assert 0 < selective.step.recompute_s < 0.5 * full.step.recompute_s  # element-wise ops only
    assert flat.step.recompute_s == 0
    # recompute_layers=12: half of the 24 blocks checkpointed, half the recompute
    half = plan_from_overrides(
        base
        + ["parallelism.dp_shard=8", "parallelism.activation_checkpointing=full", "parallelism.recompute_layers=12"]
    )
    assert half.step.recompute_s == pytest.approx(full.step.recompute_s / 2)
    # modules=[mlp]: the MLP's forward only, less than a full forward, more than the element-wise ops
    mlp = plan_from_overrides(
        base
        + [
            "parallelism.dp_shard=8",
            "parallelism.activation_checkpointing=modules",
            "parallelism.recompute_modules=[mlp]",
        ]
    )
    assert selective.step.recompute_s < mlp.step.recompute_s < full.step.recompute_s


def test_tensor_parallel_collectives_are_exposed_and_cost_more_across_nodes():
    base = BASE + ["train.global_batch_size=16", "cluster.nodes=2", "parallelism.tp=8", "parallelism.dp_replicate=2"]
    inside = plan_from_overrides(base)
    across = plan_from_overrides(base + ["cluster.nodes=4", "cluster.gpus_per_node=4", "parallelism.dp_replicate=2"])
    assert inside.step.tp_comm_s > 0
    g_in = {g.name: g for g in inside.step.groups}["tp"]
    g_across = {g.name: g for g in across.step.groups}["tp"]
    assert not g_in.crosses_nodes and g_across.crosses_nodes and g_across.bus_gbps < g_in.bus_gbps
    # 4 ranks per node share 4 NICs (4 x 45 GB/s) instead of NVLink's 360 GB/s: twice the time
    ratio = g_in.bus_gbps / g_across.bus_gbps
    assert ratio == pytest.approx(2.0) and across.step.tp_comm_s / inside.step.tp_comm_s == pytest.approx(
        ratio, rel=0.05
    )
    # a slower network (RoCE 200) slows only what crosses nodes: here the dp_replicate all-reduce
    slow = plan_from_overrides(base + ["cluster.inter_node_link=roce_200"])
    assert slow.step.tp_comm_s == pytest.approx(inside.step.tp_comm_s)
    assert slow.step.dp_comm_total_s > inside.step.dp_comm_total_s


def test_a_measured_gemm_rate_replaces_the_table():
    table = plan_from_overrides(BASE + ["train.global_batch_size=16", "parallelism.dp_shard=8"])
    measured = plan_from_overrides(
        BASE + ["train.global_batch_size=16", "parallelism.dp_shard=8", "cluster.gemm_tflops=395.8"]
    )
    assert measured.device.gemm_rate("bf16") == pytest.approx(395.8e12)
    assert 1.3 < measured.step.compute_s / table.step.compute_s < 2.0  # the GEMMs at half the rate, the rest as before


def test_state_bytes_partition_the_model_exactly():
    """Summed over every (pp, tp, dp_shard) rank, the shards hold each parameter exactly once (norm weights,
    replicated over tp, once per tp rank)."""
    cfg = validate(
        compose(
            [
                "model=tiny",
                "model.vocab_size=8193",
                "model.d_ff=150",
                "parallelism.pp=2",
                "parallelism.tp=2",
                "parallelism.dp_shard=2",
                "parallelism.pp_virtual_stages=2",
                "parallelism.pp_schedule=Interleaved1F1B",
                "train.micro_batch_size=1",
                "train.global_batch_size=4",
            ]
        ),
        world_size=8,
    )
    total = sum(
        state_bytes(cfg, "fp32", pp_rank=p, tp_rank=t, dp_shard_rank=d).numel
        for p in range(2)
        for t in range(2)
        for d in range(2)
    )
    shapes = parameter_shapes(cfg.model)
    norms = sum(math.prod(s) for name, s in shapes if "norm" in name)
    assert param_count_from_config(cfg.model) == sum(math.prod(s) for _, s in shapes)
    assert total == param_count_from_config(cfg.model) + (2 - 1) * norms
    single = validate(compose(["model=tiny"]), world_size=1)
    st = state_bytes(single, "fp32")
    assert (st.params, st.grads) == (4 * st.numel, 4 * st.numel)
    assert st.optimizer == 8 * st.numel + 4 * st.tensors
    assert state_bytes(single, "bf16").params == 2 * st.numel


def test_zbv_places_embedding_and_head_on_pipeline_rank_0():
    """ZBVZeroBubble's V: rank 0 holds the first and the last chunk, so the embedding and the head."""
    cfg = validate(
        compose(
            [
                "model=tiny",
                "parallelism.pp=2",
                "parallelism.pp_schedule=ZBVZeroBubble",
                "parallelism.pp_virtual_stages=2",
                "train.micro_batch_size=1",
                "train.global_batch_size=2",
            ]
        ),
        world_size=2,
    )
    rank0, rank1 = state_bytes(cfg, "fp32", pp_rank=0), state_bytes(cfg, "fp32", pp_rank=1)
    vocab_d = cfg.model.vocab_size * cfg.model.d_model
    assert rank0.first and rank0.last and not (rank1.first or rank1.last)
    assert rank0.root_numel_unsharded == 2 * vocab_d + cfg.model.d_model  # embedding, output, final norm
    assert rank1.root_numel_unsharded == 0
    assert rank0.layers == rank1.layers == 2


def test_trainer_start_up_memory_warning():
    cfg = validate(compose(G1), world_size=8)
    lines = []
    assert warn_if_over_memory(cfg, 10 * GIB, "h100", emit=lines.append)
    assert lines and lines[0].startswith("lmforge: warning: the planner estimates 24.7 GiB per device")
    assert not warn_if_over_memory(cfg, 80 * GIB, "h100", emit=lines.append)


def test_make_plan_on_cpu_uses_host_memory():
    cfg = validate(compose(["+exp=smoke", "cluster.device=cpu"]), world_size=1)
    plan = make_plan(cfg, 1, peak=0.3)
    assert plan.device_kind == "cpu" and plan.precision == "fp32" and plan.fits
    assert plan.usable_memory == plan.device_memory > 1 * GIB


def test_deferred_fsdp_grad_sync_counts_every_blocks_unsharded_gradient():
    """last_microbatch keeps each block's full gradient (reduce dtype) between micro batches; per micro batch,
    two blocks' are in flight plus the root's. One micro batch per step defers nothing."""
    from lmforge.config.validate import check_batch
    from lmforge.parallel.memory_estimate import estimate_memory

    def est(*extra):
        cfg = validate(
            compose(G1 + ["train.micro_batch_size=4", "parallelism.reduce_dtype=bf16", *extra]), world_size=8
        )
        return estimate_memory(cfg, check_batch(cfg), "bf16-mixed")

    every, last = est(), est("parallelism.fsdp_grad_sync=last_microbatch")
    st = every.state
    assert every.fsdp_unsharded_grads == (2 * st.max_layer_numel + st.root_numel_unsharded) * 2
    assert last.fsdp_unsharded_grads == st.stage_numel_unsharded * 2
    assert last.total - every.total == last.fsdp_unsharded_grads - every.fsdp_unsharded_grads > 0
    one = est("parallelism.fsdp_grad_sync=last_microbatch", "train.global_batch_size=32")  # 32 = 4 x 8 ranks
    assert one.fsdp_unsharded_grads == every.fsdp_unsharded_grads


def test_distributed_optimizer_preset_counts_the_whole_stage_gathered_and_its_full_gradient():
    """parallelism=distributed_optimizer (+exp=gpt_7b: dp_shard 16 x tp 2, 64 micro batches): the sharded fp32
    state, the whole rank's bf16 copy (blocks and root) and its full fp32 gradient (the embedding's the whole
    vocab table: DTensor returns it replicated over tp); ZeRO-3 per micro batch holds two blocks of each."""
    from lmforge.config.validate import check_batch
    from lmforge.parallel.memory_estimate import estimate_memory

    def est(*extra):
        cfg = validate(compose(["+exp=gpt_7b", "parallelism=distributed_optimizer", *extra]), world_size=32)
        return cfg, estimate_memory(cfg, check_batch(cfg), "bf16-mixed")

    cfg, d = est()
    p, st, m = cfg.parallelism, d.state, cfg.model
    assert (p.dp_shard, p.tp, p.param_dtype, p.reduce_dtype, p.reshard_after_forward) == (16, 2, "bf16", "fp32", False)
    assert st.params == st.numel * 4 and st.optimizer == st.numel * 8 + st.tensors * 4  # fp32 master + AdamW
    assert d.fsdp_gathered_params == st.stage_numel_unsharded * 2
    assert d.fsdp_unsharded_grads == (st.stage_numel_unsharded + m.vocab_size * m.d_model // 2) * 4
    assert d.autocast_copies == 0  # the bf16 gather replaces autocast's weight copies
    _, zero3 = est("parallelism.reshard_after_forward=true", "parallelism.fsdp_grad_sync=every_microbatch")
    assert zero3.fsdp_gathered_params == (2 * st.max_layer_numel + st.root_numel_unsharded) * 2
    assert d.total > zero3.total and d.state.total == zero3.state.total


LLAMA3_405B_MAP = [7] + [8] * 14 + [7]  # 126 blocks over 16 stages, one fewer beside the embedding and the head


def llama3_405b_like(pp_layers):
    """Llama 3 405B's shape (126 layers, d_model 16384, 128/8 heads, FFN 53248, vocabulary 128256) over
    pp=16 x tp=8 on 16 nodes of 8 H100s."""
    from lmforge.config.cluster import ClusterConfig
    from lmforge.config.model import ModelConfig
    from lmforge.config.parallelism import ParallelismConfig
    from lmforge.config.schema import RootConfig
    from lmforge.config.train import TrainConfig

    model = ModelConfig(
        name="llama3_405b_like",
        vocab_size=128256,
        d_model=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        d_ff=53248,
        seq_len=8192,
        tie_embeddings=False,
    )
    par = ParallelismConfig(name="pp16_tp8", tp=8, pp=16, pp_layers=pp_layers, activation_checkpointing="full")
    train = TrainConfig(micro_batch_size=1, global_batch_size=16, precision="bf16-mixed")
    cluster = ClusterConfig(name="h100", nodes=16, gpus_per_node=8, device="h100")
    return RootConfig(model=model, parallelism=par, train=train, cluster=cluster)


def test_planner_counts_each_pipeline_ranks_blocks_from_the_stage_map():
    """126 layers over pp=16 with the Llama-3 map: every rank's state counts the map's blocks (first and last 7, the
    rest 8) and the plan prints the map; another map moves the counts with it (the map is read, not assumed)."""
    cfg = validate(llama3_405b_like(LLAMA3_405B_MAP), world_size=128)
    ranks = [state_bytes(cfg, "bf16-mixed", pp_rank=r) for r in range(16)]
    assert [st.layers for st in ranks] == LLAMA3_405B_MAP
    assert ranks[0].first and not ranks[0].last and ranks[15].last and not any(st.first for st in ranks[1:])
    per_layer = ranks[1].numel // 8  # (tp-local; no FSDP: numel is the rank's whole share)
    assert ranks[1].numel == ranks[2].numel == 8 * per_layer
    for edge in (ranks[0], ranks[15]):  # 7 blocks + the tp-split embedding / final norm and output
        assert edge.numel - edge.root_numel_unsharded == 7 * per_layer
    plan = make_plan(cfg)
    assert sorted(plan.memory.per_stage_total) == list(range(16))
    from lmforge.parallel.planner import format_plan

    assert f"stage map pp_layers {LLAMA3_405B_MAP}: blocks per pipeline rank {LLAMA3_405B_MAP}" in format_plan(plan)
    moved = validate(llama3_405b_like([6] + [8] * 15), world_size=128)
    assert [state_bytes(moved, "bf16-mixed", pp_rank=r).layers for r in (0, 1, 15)] == [6, 8, 8]
    with pytest.raises(ConfigError) as err:  # no map: refused, the Llama-3 map suggested
        validate(llama3_405b_like(None), world_size=128)
    assert "parallelism.pp_layers=[7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7]" in err.value.fix
