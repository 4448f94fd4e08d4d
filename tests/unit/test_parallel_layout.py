"""Single-process checks of the parallel layout: validation messages and the pipeline stage plan."""

from __future__ import annotations

import re

import pytest

from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate
from lmforge.parallel.pipeline import plan_stages

TINY = ["model=tiny", "model.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=8"]


def check(overrides, world_size):
    return validate(compose(TINY + overrides), world_size=world_size)


@pytest.mark.parametrize(
    "preset,world",
    [
        ("single", 1),
        ("ddp", 2),
        ("fsdp", 2),
        ("fsdp_zero2", 2),
        ("distributed_optimizer", 2),
        ("tp2", 2),
        ("tp2_sp", 2),
        ("pp2", 2),
        ("pp2_interleaved", 2),
        ("pp2_zb", 2),
        ("tp2_dp2", 4),
        ("pp2_dp2", 4),
        ("tp2_pp2", 4),
        ("hsdp", 4),
    ],
)
def test_every_preset_validates_for_its_world_size(preset, world):
    cfg = check([f"parallelism={preset}"], world)
    p = cfg.parallelism
    assert p.dp_replicate * p.dp_shard * p.tp * p.pp == world


def test_3d_preset_needs_eight_ranks():
    cfg = validate(
        compose(["model=tiny", "train.micro_batch_size=1", "train.global_batch_size=8", "parallelism=3d"]), world_size=8
    )
    assert (cfg.parallelism.pp, cfg.parallelism.dp_shard, cfg.parallelism.tp) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"= 8 but the job has world size 4"):
        validate(compose(["model=tiny", "parallelism=3d"]), world_size=4)


@pytest.mark.parametrize(
    "overrides,key,text",
    [
        (
            ["parallelism=pp2", "model.tie_embeddings=true"],
            "model.tie_embeddings",
            "tied input/output embeddings would live on the first and the last pipeline stage",
        ),
        (
            ["parallelism=pp2", "parallelism.pp_schedule=ZBVZeroBubble"],
            "parallelism.pp_virtual_stages",
            "ZBVZeroBubble runs exactly 2 stages per rank, got 1",
        ),
        (
            ["parallelism=pp2", "parallelism.pp_microbatches=3"],
            "parallelism.pp_microbatches",
            "8 sequences per data-parallel rank and step (micro_batch_size x grad_accum) do not split into 3 pipeline "
            "microbatches",
        ),
        (
            ["parallelism=pp2", "parallelism.pp_virtual_stages=2"],
            "parallelism.pp_virtual_stages",
            "1F1B runs one stage per rank",
        ),
        (
            ["parallelism=pp2_zb", "parallelism.compile=true"],
            "parallelism.compile",
            "InterleavedZeroBubble splits backward into input and weight parts",
        ),
        (
            ["parallelism=tp2", "parallelism.compile=true"],
            "parallelism.compile",
            "torch.compile of tensor-parallel blocks fails in the first backward",
        ),
        (
            ["parallelism=tp2", "model.n_kv_heads=1"],
            "parallelism.tp",
            "n_heads (4) and n_kv_heads (1) must both be divisible by tp (2)",
        ),
        (
            ["parallelism=fsdp", "parallelism.fsdp_grad_sync=every_micro"],
            "parallelism.fsdp_grad_sync",
            "'every_micro' is not one of auto, every_microbatch, last_microbatch",
        ),
        (
            ["parallelism=ddp", "parallelism.fsdp_grad_sync=every_microbatch"],
            "parallelism.fsdp_grad_sync",
            "every_microbatch is not possible here: only FSDP (dp_shard > 1) can reduce per micro batch",
        ),
    ],
)
def test_invalid_layouts_name_key_reason_and_fix(overrides, key, text):
    with pytest.raises(ConfigError) as err:
        check(overrides, 2)
    assert err.value.key == key
    assert text in str(err.value)
    assert err.value.fix


@pytest.mark.parametrize(
    "overrides,text",
    [
        (
            ["parallelism=pp2_zb", "parallelism.dp_shard=2", "parallelism.reshard_after_forward=true"],
            "InterleavedZeroBubble with FSDP (dp_shard=2, cp=1) and reshard_after_forward=true loses weight gradients",
        ),
        (
            [
                "parallelism=pp2",
                "parallelism.pp_schedule=ZBVZeroBubble",
                "parallelism.pp_virtual_stages=2",
                "parallelism.cp=2",
            ],
            "ZBVZeroBubble with FSDP (dp_shard=1, cp=2) and reshard_after_forward=true loses weight gradients",
        ),
    ],
)
def test_zero_bubble_with_fsdp_resharding_after_forward_is_refused(overrides, text, capsys):
    """Zero bubble x FSDP with blocks resharded after forward trains on wrong weight gradients (torch 2.13;
    test_parallel_parity.py's pp2_zb_fsdp_resharded measures it): refused in one line, exit 2 (lmforge plan)."""
    with pytest.raises(ConfigError) as err:
        check(overrides, 4)
    assert err.value.key == "parallelism.reshard_after_forward"
    assert text in str(err.value)
    assert "set parallelism.reshard_after_forward=false" in err.value.fix and "1F1B" in err.value.fix
    from lmforge.parallel import plan_cli

    assert plan_cli.main(TINY + overrides + ["cluster.gpus_per_node=4"]) == 2  # one line, exit 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "lmforge plan: refused: config key 'parallelism.reshard_after_forward': "
    )


def test_zero_bubble_with_fsdp_validates_with_blocks_gathered():
    """Control of the refusal: the pp2_zb preset with dp_shard=2, 1F1B resharding after forward, and zero bubble
    over dp_replicate (no FSDP) validate."""
    assert check(["parallelism=pp2_zb", "parallelism.dp_shard=2"], 4).parallelism.reshard_after_forward is False
    check(["parallelism=pp2_dp2", "parallelism.reshard_after_forward=true"], 4)
    check(["parallelism=pp2_zb", "parallelism.dp_replicate=2", "parallelism.reshard_after_forward=true"], 4)


def test_fsdp_grad_sync_modes_resolve_per_layout():
    from lmforge.config.parallelism import fsdp_grad_sync_mode

    assert fsdp_grad_sync_mode(check(["parallelism=fsdp"], 2).parallelism) == "every_microbatch"
    assert (
        fsdp_grad_sync_mode(check(["parallelism=fsdp", "parallelism.fsdp_grad_sync=last_microbatch"], 2).parallelism)
        == "last_microbatch"
    )
    # Pipeline schedules reduce once per step (torch.distributed.pipelining); DDP uses no_sync.
    assert fsdp_grad_sync_mode(check(["parallelism=pp2_dp2"], 4).parallelism) == "last_microbatch"
    assert fsdp_grad_sync_mode(check(["parallelism=ddp"], 2).parallelism) == "last_microbatch"
    with pytest.raises(ConfigError, match="pipeline schedules reduce FSDP gradients once per step") as err:
        check(["parallelism=pp2_dp2", "parallelism.fsdp_grad_sync=every_microbatch"], 4)
    assert err.value.fix == "set parallelism.fsdp_grad_sync=auto (or last_microbatch)"


@pytest.mark.parametrize(
    "schedule,virtual,expected",
    [
        ("1F1B", 1, {0: ["0", "1"], 1: ["2", "3"]}),
        ("Interleaved1F1B", 2, {0: ["0", "2"], 1: ["1", "3"]}),
        ("ZBVZeroBubble", 2, {0: ["0", "3"], 1: ["1", "2"]}),
    ],
)
def test_stage_plan_keeps_global_layer_names(schedule, virtual, expected):
    cfg = check(
        ["parallelism.pp=2", f"parallelism.pp_schedule={schedule}", f"parallelism.pp_virtual_stages={virtual}"], 2
    )
    plan = plan_stages(4, cfg.parallelism)
    for rank, layers in expected.items():
        assert [name for s in plan.local_stages(rank) for name in plan.layers[s]] == layers
    assert plan.stage_to_rank[0] == 0


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["parallelism.pp_layers=[3,2]"], {0: ["0", "1", "2"], 1: ["3", "4"]}),
        (["parallelism.pp_layers=[1,4]"], {0: ["0"], 1: ["1", "2", "3", "4"]}),
        (
            [
                "parallelism.pp_schedule=Interleaved1F1B",
                "parallelism.pp_virtual_stages=2",
                "parallelism.pp_layers=[1,2,1,1]",
            ],
            {0: ["0", "3"], 1: ["1", "2", "4"]},
        ),
    ],
)
def test_stage_map_gives_each_stage_its_blocks(overrides, expected):
    """``parallelism.pp_layers``: stage s holds the map's count of consecutive blocks, placed by the schedule."""
    cfg = check(["model.n_layers=5", "parallelism.pp=2"] + overrides, 2)
    plan = plan_stages(5, cfg.parallelism)
    for rank, layers in expected.items():
        assert [name for s in plan.local_stages(rank) for name in plan.layers[s]] == layers


UNEVEN = ["model.n_layers=5", "parallelism.pp=2"]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            [],
            "config key 'parallelism.pp_layers': n_layers (5) is not divisible by pp*pp_virtual_stages (2) and no "
            "stage map is set. Fix: set parallelism.pp_layers=[2,3] (blocks per pipeline chunk, fewer on the chunks "
            "holding the embedding and the output head), or choose pp and pp_virtual_stages whose product divides "
            "n_layers",
        ),
        (
            ["parallelism.pp_layers=[2,2]"],
            "config key 'parallelism.pp_layers': [2, 2] sums to 4 but model.n_layers is 5. "
            "Fix: give block counts summing to 5, e.g. parallelism.pp_layers=[2,3]",
        ),
        (
            ["parallelism.pp_layers=[1,1,3]"],
            "config key 'parallelism.pp_layers': [1, 1, 3] has 3 entries but pp*pp_virtual_stages = 2 pipeline "
            "chunks. Fix: give one block count per chunk, in chunk order, e.g. parallelism.pp_layers=[2,3]",
        ),
        (
            ["parallelism.pp_layers=[0,5]"],
            "config key 'parallelism.pp_layers': [0, 5] gives a pipeline chunk no block. "
            "Fix: give every chunk at least one block, e.g. parallelism.pp_layers=[2,3]",
        ),
        (
            ["model.n_layers=1"],
            "config key 'parallelism.pp': n_layers (1) is fewer than pp*pp_virtual_stages (2) pipeline chunks. "
            "Fix: choose pp and pp_virtual_stages with at most one chunk per layer",
        ),
    ],
)
def test_bad_stage_map_is_one_line_naming_the_key_and_a_map_that_works(overrides, message):
    with pytest.raises(ConfigError) as err:
        check(UNEVEN + overrides, 2)
    assert str(err.value) == message
    assert "\n" not in str(err.value)
    suggested = re.search(r"parallelism\.pp_layers=\[[0-9,]+\]", err.value.fix)
    if suggested:  # the suggested map validates
        check(UNEVEN + [suggested.group(0)], 2)


def test_suggested_maps_put_the_fewer_blocks_on_the_end_chunks():
    from lmforge.config.parallelism import suggested_pp_layers

    assert suggested_pp_layers(126, 16) == [7] + [8] * 14 + [7]  # Llama 3 405B over 16 stages
    assert suggested_pp_layers(6, 4) == [1, 2, 2, 1]
    assert suggested_pp_layers(7, 3) == [2, 3, 2]
    assert suggested_pp_layers(8, 4) == [2, 2, 2, 2]  # divisible: the even split


def test_stage_map_with_an_even_count_and_pp1():
    """A map equal to the even split is the even split; pp=1 takes a one-entry map."""
    even = plan_stages(4, check(["parallelism.pp=2", "parallelism.pp_layers=[2,2]"], 2).parallelism)
    assert even.layers == plan_stages(4, check(["parallelism.pp=2"], 2).parallelism).layers
    assert check(["parallelism.pp_layers=[4]"], 1).parallelism.pp_layers == [4]
