"""``parallelism.ep`` before any process group: the one-line refusals (config/moe_checks.check_expert_parallel), the
planner's experts per device and token all-to-all volume (parallel/planner.py, memory_estimate.py), and
``lmforge plan``'s exit code 2. The all-to-all dispatch itself runs on real gloo ranks in
tests/distributed/test_parallel_parity.py (ep2, ep2 x dp2, misrouted-token control, ep2 -> ep1 resume)."""

from __future__ import annotations

import math

import pytest

from lmforge.config.batch import batch_plan
from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.model import MoEConfig
from lmforge.config.moe_checks import check_expert_parallel
from lmforge.config.schema import RootConfig
from lmforge.config.validate import validate
from lmforge.model.moe import expert_hidden_dim, moe_layer_ids
from lmforge.parallel import plan_cli
from lmforge.parallel.memory_estimate import state_bytes
from lmforge.parallel.planner import ep_all_to_all_bytes


def root(experts: int = 4, **layout) -> RootConfig:
    r = RootConfig()
    r.model.moe = MoEConfig(experts=experts, top_k=2)
    r.parallelism.dp_shard = 2
    for k, v in layout.items():
        setattr(r.parallelism, k, v)
    return r


@pytest.mark.parametrize(
    "experts, layout, key, reason",
    [
        (0, {"ep": 2}, "parallelism.ep", "ep=2 needs a Mixture-of-Experts model (model.moe.experts=0)"),
        (
            4,
            {"ep": 4},
            "parallelism.ep",
            "ep (4) must divide parallelism.dp_shard (2): ep ranks are borrowed from the FSDP ranks",
        ),
        (
            6,
            {"ep": 4, "dp_shard": 4},
            "parallelism.ep",
            "model.moe.experts (6) is not divisible by ep (4): each ep rank holds experts/ep experts",
        ),
        (4, {"ep": 2, "engine": "deepspeed"}, "parallelism.ep", "expert parallelism is a native-engine layout"),
        (
            4,
            {"ep": 2, "tp": 2, "pp": 2},
            "parallelism.ep",
            "ep=2 with both tp (2) and pp (2) is not verified (ep x tp and ep x pp are, each on 4 ranks)",
        ),
        (4, {"ep": 2, "cp": 2}, "parallelism.cp", "not supported with parallelism.ep > 1 (ep=2): not verified"),
    ],
)
def test_ep_refusals_name_key_reason_fix(experts, layout, key, reason):
    with pytest.raises(ConfigError) as err:
        check_expert_parallel(root(experts, **layout))
    assert err.value.key == key and err.value.reason == reason and err.value.fix
    check_expert_parallel(root(4, ep=2))  # control: ep dividing both dp_shard and the experts passes,
    check_expert_parallel(root(4, ep=2, tp=2, sequence_parallel=True))  # with tp (+SP)
    check_expert_parallel(root(4, ep=2, pp=2))  # and with pp 1F1B (parity: test_parallel_parity.py)
    # and zero bubble (parity: moe_ep2_pp2_zbv; its FSDP resharding refused in config/validate.py, not here)
    check_expert_parallel(root(4, ep=2, pp=2, pp_schedule="ZBVZeroBubble", pp_virtual_stages=2))
    check_expert_parallel(root(4, ep=2, compile=True))  # compile composes with ep (test_compile_layouts)
    check_expert_parallel(RootConfig())  # and the dense default (ep=1)


def test_validate_runs_the_ep_check_and_lmforge_plan_exits_2_in_one_line(capsys):
    moe = ["model=tiny", "model.moe.experts=4", "model.moe.top_k=2", "parallelism=fsdp", "train.micro_batch_size=2"]
    assert validate(compose(moe + ["parallelism.ep=2"]), world_size=2).parallelism.ep == 2
    with pytest.raises(ConfigError, match="'parallelism.ep': must be >= 1, got 0"):
        validate(compose(moe + ["parallelism.ep=0"]), world_size=2)
    assert (
        plan_cli.main(
            [
                "model=tiny",
                "parallelism.ep=2",
                "parallelism.dp_shard=2",
                "cluster.gpus_per_node=2",
                "train.micro_batch_size=2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "lmforge plan: refused: config key 'parallelism.ep': ep=2 needs a Mixture-of-Experts model "
        "(model.moe.experts=0). Fix: set parallelism.ep=1 for the dense model, or model.moe.experts to a "
        "multiple of ep"
    ]


def tiny_moe(**layout) -> RootConfig:
    """The default model with 8 experts top-2 in every other layer (a typed config: the planner needs no compose)."""
    r = RootConfig()
    r.model.moe = MoEConfig(experts=8, top_k=2, d_ff=64, every_n_layers=2)
    for k, v in layout.items():
        setattr(r.parallelism, k, v)
    check_expert_parallel(r)
    return r


def test_planner_counts_experts_per_device_and_the_all_to_all():
    m = tiny_moe().model
    expert_numel = 3 * m.d_model * expert_hidden_dim(m)  # w1, w2, w3 of one expert
    layers = len(moe_layer_ids(m))
    for layout, per_rank in [
        ({"dp_shard": 4}, 8 / 4),
        ({"dp_shard": 4, "ep": 2}, 8 / 2 / 2),
        ({"dp_shard": 4, "ep": 4}, 8 / 4),
        ({"dp_shard": 2, "dp_replicate": 2, "ep": 2}, 8 / 2),
    ]:  # HSDP: replicas hold the same
        st = state_bytes(tiny_moe(**layout), "fp32")
        assert st.expert_numel == layers * per_rank * expert_numel, layout
    # ep=2 and ep=4 hold as many expert weights per device (E/ep experts over dp/ep FSDP ranks), but FSDP's
    # all-gathers gather only a rank's E/ep experts: 2 experts fewer per MoE layer at ep=4.
    gathered = {ep: state_bytes(tiny_moe(dp_shard=4, ep=ep), "fp32").stage_numel_unsharded for ep in (2, 4)}
    assert gathered[2] - gathered[4] == layers * 2 * expert_numel
    cfg = tiny_moe(dp_shard=4, ep=2)
    plan = batch_plan(micro_batch_size=2, global_batch_size=16, dp_size=4, seq_len=m.seq_len)  # grad_accum 2
    rows = 2 * m.seq_len * 2  # micro batch tokens x top_k
    expected = layers * 2 * rows * m.d_model * 4 // 2 * 4  # fp32, half leaves the rank, 4 exchanges per micro batch
    assert ep_all_to_all_bytes(cfg, plan, "fp32") == expected
    cfg.parallelism.activation_checkpointing = "full"  # the forward exchange again in the recompute
    assert ep_all_to_all_bytes(cfg, plan, "fp32") == expected * 6 // 4
    assert ep_all_to_all_bytes(tiny_moe(dp_shard=4), plan, "fp32") == 0  # control: no ep, no all-to-all
    assert math.isclose(ep_all_to_all_bytes(tiny_moe(dp_shard=4, ep=4), plan, "fp32"), expected * 1.5)  # 3/4 leave


def test_planner_experts_and_all_to_all_with_tp_and_pp(capsys):
    """tp replicates the experts and every tp rank dispatches its whole (under SP: gathered) sequence over its own ep
    group: the same rows as without tp; a pipeline rank dispatches for the MoE layers it holds only."""
    m = tiny_moe().model  # 4 layers, MoE layers 1 and 3
    plan = batch_plan(micro_batch_size=2, global_batch_size=8, dp_size=2, seq_len=m.seq_len)  # grad_accum 2
    ep2 = ep_all_to_all_bytes(tiny_moe(dp_shard=2, ep=2), plan, "fp32")
    assert ep2 > 0
    assert ep_all_to_all_bytes(tiny_moe(dp_shard=2, ep=2, tp=2, sequence_parallel=True), plan, "fp32") == ep2
    assert ep_all_to_all_bytes(tiny_moe(dp_shard=2, ep=2, pp=2), plan, "fp32") == ep2 // 2  # 1F1B: one layer each
    assert ep_all_to_all_bytes(tiny_moe(dp_shard=2, ep=2, pp=2, pp_microbatches=4), plan, "fp32") == ep2 // 2
    looped = tiny_moe(dp_shard=2, ep=2, pp=2, pp_schedule="Interleaved1F1B", pp_virtual_stages=2)
    assert ep_all_to_all_bytes(looped, plan, "fp32") == ep2  # layers 1 and 3 both on pipeline rank 1
    expert_numel = 3 * m.d_model * expert_hidden_dim(m)
    for tp_rank in (0, 1):  # 4 of 8 experts per MoE layer on every tp rank: not split by tp
        st = state_bytes(tiny_moe(dp_shard=2, ep=2, tp=2), "fp32", tp_rank=tp_rank)
        assert st.expert_numel == 2 * 4 * expert_numel
    for pp_rank in (0, 1):  # a stage holds its own MoE layer's experts
        assert state_bytes(tiny_moe(dp_shard=2, ep=2, pp=2), "fp32", pp_rank=pp_rank).expert_numel == 4 * expert_numel
    base = [
        "model=tiny",
        "model.moe.experts=4",
        "model.moe.top_k=2",
        "parallelism.dp_shard=2",
        "parallelism.ep=2",
        "cluster.gpus_per_node=4",
        "train.micro_batch_size=2",
    ]
    lines = {}
    for name, extra in (
        ("tp", ["parallelism.tp=2", "parallelism.sequence_parallel=true"]),
        ("pp", ["parallelism.pp=2", "model.moe.every_n_layers=2"]),
    ):
        assert plan_cli.main(base + extra) == 0
        lines[name] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ep ")]
    assert lines["tp"] and "2 of 4 experts per rank, replicated over tp 2, FSDP over 1" in lines["tp"][0]
    assert lines["pp"] and "2 of 4 experts per rank in each of its 1 MoE layers, FSDP over 1" in lines["pp"][0]
