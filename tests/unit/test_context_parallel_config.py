"""``parallelism.cp``: its one-line refusals, the load-balanced layout, and the planner's cp terms."""

from __future__ import annotations

import pytest

from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.validate import check_batch, validate
from lmforge.parallel.memory_estimate import estimate_memory
from lmforge.parallel.plan_cli import plan_from_overrides
from lmforge.parallel.planner import cp_exchange_bytes, format_plan

TINY = ["model=tiny", "model.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=8"]

REFUSED = {
    "chunks": (
        ["parallelism.cp=2", "model.seq_len=30"],
        2,
        "config key 'parallelism.cp': seq_len (30) is not divisible by 2*cp (4): the load-balanced layout "
        "splits each sequence into 2*cp equal chunks. Fix: choose a seq_len divisible by 4 (or a cp dividing "
        "seq_len/2)",
    ),
    "world": (
        ["parallelism.cp=2", "parallelism.dp_shard=2"],
        2,
        "config key 'parallelism': dp_replicate*dp_shard*cp*tp*pp = 1*2*2*1*1 = 4 but the job has world size 2. "
        "Fix: start 4 processes: lmforge launch --nproc 4 <same overrides> (torchrun --nproc_per_node=4 -m "
        "lmforge.train <same overrides>), or choose a layout of 2",
    ),
    "selective": (
        ["parallelism.cp=2", "parallelism.activation_checkpointing=selective"],
        2,
        "config key 'parallelism.activation_checkpointing': selective checkpointing would recompute the "
        "context-parallel K/V exchange op by op. Fix: use activation_checkpointing=full (or none) with cp > 1",
    ),
    "docmask_flex": (
        [
            "parallelism.cp=2",
            "data.document_masking=true",
            "data.document_attention=flex",
            "train.device=cuda",
            "parallelism.compile=true",
        ],
        2,
        "config key 'data.document_attention': flex is not used with context parallelism (cp > 1): the cp "
        "K/V exchange applies the document mask itself, block by block. Fix: set "
        "data.document_attention=sdpa for cp > 1",
    ),
    "loss_after_eod": (
        ["parallelism.cp=2", "data.loss_after_eod=mask"],
        2,
        "config key 'data.loss_after_eod': mask with context parallelism (cp > 1) would average per-rank "
        "means over different numbers of kept targets (the masked targets fall unevenly on the cp "
        "ranks), which is not the mean over the sequence. Fix: set data.loss_after_eod=keep for cp > 1",
    ),
    "eval_tasks": (
        ["parallelism.cp=2", "eval.tasks=[austen_next_sentence]"],
        2,
        "config key 'eval.tasks': in-loop task evaluation with context parallelism (cp > 1) is not "
        "supported yet: its requests are not cut into the cp layout. Fix: set eval.tasks=[] for the cp run "
        "and score its checkpoints with `python -m lmforge.evaluation.offline RUN`",
    ),
    "exchange": (
        ["parallelism.cp=2", "parallelism.cp_kv_exchange=alltoall"],
        2,
        "config key 'parallelism.cp_kv_exchange': 'alltoall' is not one of ring, allgather. "
        "Fix: choose one of ring, allgather",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_cp_layouts_are_refused_with_one_line(case):
    overrides, world, message = REFUSED[case]
    with pytest.raises(ConfigError) as err:
        validate(compose(TINY + overrides), world_size=world)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_cp_ranks_share_the_data_parallel_batch():
    """The batch plan's data-parallel size excludes cp: both cp ranks of a group read the same samples."""
    cfg = validate(compose(TINY + ["parallelism=cp2_dp2"]), world_size=4)
    assert check_batch(cfg).dp_size == 2 and check_batch(cfg).grad_accum == 2
    control = validate(compose(TINY + ["parallelism.dp_shard=4"]), world_size=4)
    assert check_batch(control).dp_size == 4


def test_load_balanced_layout_holds_mirrored_chunks():
    import torch

    from lmforge.parallel.context_parallel import ContextLayout, ring_plan

    seq = torch.arange(16)[None]
    held = [ContextLayout(4, r, 16).shard(seq)[0].tolist() for r in range(4)]
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert sorted(sum(held, [])) == list(range(16))
    assert ContextLayout(4, 2, 16).positions().tolist() == held[2]
    # rank 2's ring: its own block (masked), then ranks 1, 0 (first key chunk only), 3 (second query chunk only)
    plans = [ring_plan(ContextLayout(4, 2, 16), t) for t in range(4)]
    assert [(src, masked) for src, _, _, masked in plans] == [(2, True), (1, False), (0, False), (3, False)]
    assert plans[1][2] == slice(0, 2) and plans[3][1] == slice(2, 4)


def test_planner_divides_activations_by_cp_and_counts_the_kv_exchange():
    base = TINY + ["model.seq_len=1024", "train.global_batch_size=2", "train.micro_batch_size=2"]
    one = validate(compose(base), world_size=1)
    ring = validate(compose(base + ["parallelism=cp2"]), world_size=2)
    gather = validate(compose(base + ["parallelism=cp2", "parallelism.cp_kv_exchange=allgather"]), world_size=2)
    est = {
        name: estimate_memory(c, check_batch(c), "fp32")
        for name, c in (("one", one), ("ring", ring), ("gather", gather))
    }
    # Every activation term is per token: a cp rank holds half of them (the head's log-probs included).
    assert est["ring"].activations * 2 == est["one"].activations
    # All-gather also keeps the other rank's K/V per layer, at the K/V heads (2 of 4, head_dim 16: 32 features):
    # 2 * 1024 tokens * 32 * 4 bytes * 4 layers.
    assert est["gather"].activations - est["ring"].activations == 4 * 2 * 1024 * 32 * 4
    assert est["ring"].state.params * 2 == est["one"].state.params  # FSDP over cp: sharded 2 ways
    # K/V exchange per rank and step: per layer, a block of 2 * 1024 * 32 values (n_kv_heads 2 x head_dim 16, half
    # of d_model: exchanged before the GQA expansion); ring: 1 fp32 block forward, 1 backward plus 2 fp32 dK/dV
    # blocks; all-gather: 1 forward, 1 backward. Multi-query (1 K/V head) moves half of that again.
    block = 2 * 1024 * 32 * 4
    assert cp_exchange_bytes(ring, check_batch(ring), "fp32") == 4 * (block + block + 2 * block)
    assert cp_exchange_bytes(gather, check_batch(gather), "fp32") == 4 * 2 * block
    assert cp_exchange_bytes(one, check_batch(one), "fp32") == 0
    mqa = validate(compose(base + ["parallelism=cp2", "model.n_kv_heads=1"]), world_size=2)
    assert cp_exchange_bytes(mqa, check_batch(mqa), "fp32") * 2 == cp_exchange_bytes(ring, check_batch(ring), "fp32")


def test_plan_shows_cp_for_the_long_context_preset():
    text = format_plan(plan_from_overrides(["+exp=gpt_1b_32k"]))
    assert "mesh       pp=1 x dp_replicate=1 x dp_shard=1 x cp=8 x tp=1  (cp groups within a node)" in text
    assert "cp         8 ranks per sequence (ring): 4096 of 32768 tokens per rank (chunks of 2048)" in text
    assert "fits       yes" in text
