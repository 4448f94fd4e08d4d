"""``lmforge plan --search`` covers the layouts of the published runs (``published_runs.csv``): every row's layout
is one the search enumerates (``layout_search.search_space_miss``), the search's best is predicted at least as
fast as the published layout, pruning keeps the exhaustive best, and the earlier space (powers of two, two
virtual stages, the four largest power-of-two micro batches, no FSDP with parameters kept through the step)
misses rows: the negative control."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the benchmarks package, as tests/unit/test_planner_validation.py does

from benchmarks.planner_validation import search_space_misses  # noqa: E402
from lmforge.config.validate import validate  # noqa: E402
from lmforge.parallel import layout_search  # noqa: E402
from lmforge.parallel.layout_search import search_layouts  # noqa: E402
from lmforge.parallel.planner import make_plan  # noqa: E402
from lmforge.parallel.published_runs import load_published_runs, to_root_config  # noqa: E402

# Published rows whose layout the search does not enumerate, with the reason (none at present).
OUTSIDE: dict = {}


def test_every_published_layout_is_inside_the_search_space():
    assert search_space_misses() == OUTSIDE


def test_the_documented_figure_is_the_computed_one():
    """docs/planner.md's figure is what ``python -m benchmarks.planner_validation --search-space`` prints."""
    total = len(load_published_runs())
    inside = total - len(search_space_misses())
    text = " ".join((REPO / "docs" / "planner.md").read_text().split())
    assert f"Of all {total} published layouts {inside} are inside the search space" in text


def _powers(limit: int) -> list:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


@pytest.fixture
def earlier_space(monkeypatch):
    """The search space before it took divisors: pp powers of two, Interleaved1F1B at 2 virtual stages only, the
    four largest power-of-two micro batches, FSDP always freeing gathered parameters after forward."""

    def pp_choices(cfg, world):
        m = cfg.model
        return [
            pp for pp in _powers(world) if world % pp == 0 and pp <= m.n_layers and (pp == 1 or not m.tie_embeddings)
        ]

    def micro_choices(batch, dp, pp=1):
        per = batch // dp
        return [mb for mb in _powers(per) if per % mb == 0][::-1][:4]

    def sharding_choices(dp, cp, per_node, tp):
        return [s for s in sharding_kept(dp, cp, per_node, tp) if s[3] == "auto"]

    sharding_kept = layout_search.sharding_choices
    monkeypatch.setattr(layout_search, "pp_choices", pp_choices)
    monkeypatch.setattr(layout_search, "virtual_choices", lambda n_layers, pp: [2] if n_layers >= 2 * pp else [])
    monkeypatch.setattr(layout_search, "micro_choices", micro_choices)
    monkeypatch.setattr(layout_search, "sharding_choices", sharding_choices)


def test_the_earlier_search_space_misses_published_layouts(earlier_space):
    misses = search_space_misses()
    assert len(misses) == 34, misses
    assert misses["bloom176b_tr11"].startswith("pp=12 ")  # BLOOM's 12 stages
    assert misses["mcore08_h100_177b"].startswith("pp=6 ")
    assert misses["narayanan21_t1_530b"].startswith("pp=35 ")
    assert misses["narayanan21_t1_76b"].startswith("pp_virtual_stages=3 ")  # 3 chunks per rank
    assert misses["mpt_h100_bf16_30b_s2048_g8"] == "micro_batch_size=3 (the search tries 1)"
    assert misses["torchtitan25_asynctp_8b_bf16_async_tp"].startswith("micro_batch_size=12 ")
    # Megatron's distributed optimizer: parameters gathered once per step, not freed after each forward
    assert misses["mcore08_h100_119b"].startswith("reshard_after_forward=False ")


@pytest.mark.parametrize(
    "run_id",
    [
        "narayanan21_t1_1.7b",  # DDP, tied embeddings: no pipeline
        "mpt_h100_bf16_30b_s2048_g8",  # micro batch 3
        "torchtitan24_t2_8b_cp1",
        "torchtitan25_asynctp_8b_bf16_async_tp",  # micro batch 12
        "bloom176b_tr11",  # 12 pipeline stages over 70 layers
    ],
)
def test_the_search_finds_a_layout_at_least_as_fast_as_the_published_one(run_id):
    run = next(r for r in load_published_runs() if r.id == run_id)
    validated = validate(to_root_config(run).cfg, world_size=run.gpus)
    published = make_plan(validated, run.gpus)
    assert published.fits
    cands, feasible = search_layouts(validated.cfg, run.gpus, top=5)
    assert feasible >= len(cands) == 5
    assert cands[0].plan.tokens_per_s >= published.tokens_per_s * (1 - 1e-9), (cands[0].overrides, published)


def test_pruning_keeps_the_exhaustive_best():
    run = next(r for r in load_published_runs() if r.id == "torchtitan24_t2_8b_cp1")  # 8 GPUs, pp up to 8
    cfg = to_root_config(run).cfg
    pruned, n_pruned = search_layouts(cfg, run.gpus, top=3)
    every, n_every = search_layouts(cfg, run.gpus, top=10**6, prune=False)
    assert n_pruned < n_every == len(every)  # dominated choices (a heavier recompute, a smaller micro batch) dropped
    assert [c.plan.tokens_per_s for c in pruned] == [c.plan.tokens_per_s for c in every[:3]]
    assert any(re.search(r"parallelism\.pp=[2-8] ", c.overrides) for c in every)  # pipelined layouts compared too


def test_the_widened_layouts_plan_the_same_when_their_overrides_are_given_back():
    from lmforge.parallel.plan_cli import plan_from_overrides

    base = ["model=gpt_125m", "cluster=h100_node", "train.global_batch_size=48", "train.micro_batch_size=6"]
    base.append("model.tie_embeddings=false")
    plan = plan_from_overrides(base + ["parallelism.dp_shard=8"])
    cfg = plan.cfg.cfg  # the validated config's RootConfig
    usable = 80 * 2**30
    structures = list(layout_search._structures(cfg, 8))
    picks = [  # (what the layout has that the powers-of-two space lacked, structure, micro batch)
        ("3 virtual stages", next(p for p in structures if p["pp_virtual_stages"] == 3), 1),
        ("kept parameters", next(p for p in structures if p["pp"] == 1 and p["fsdp_grad_sync"] != "auto"), 3),
        ("uneven 8 x 2 chunks", next(p for p in structures if p["pp"] == 8 and p["pp_layers"]), 1),
    ]
    for what, par, micro in picks:
        overrides = layout_search.overrides_text(par, micro, "full")
        searched = layout_search._try(cfg, 8, par, micro, "full", usable)
        assert searched is not None and searched.fits, what
        again = plan_from_overrides(base + overrides.split())
        assert again.fits and again.step_time_s == pytest.approx(searched.step_time_s, rel=1e-9), overrides
