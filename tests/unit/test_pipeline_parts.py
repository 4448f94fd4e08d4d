"""Pipeline parts built by the GPT constructor, and their stages (one process).

A pipeline rank's part is ``GPT(cfg, layers, embedding, head)`` (``parallel/pipeline.rank_part``); its stages are
``GPTStage`` modules over the part's own submodules (``GPT.stage``). The name-keyed init makes a part's parameters
equal to the whole model's of the same name, and chaining the stages of every rank reproduces the whole model.
"""

from __future__ import annotations

import pytest
import torch

from lmforge.config.model import ModelConfig
from lmforge.config.parallelism import ParallelismConfig
from lmforge.model.gpt import GPT
from lmforge.parallel.pipeline import build_stages, plan_stages, rank_part


def tiny(**kw) -> ModelConfig:
    return ModelConfig(
        **{
            **dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=16, tie_embeddings=False),
            **kw,
        }
    )  # tied embeddings across stages: refused


def parts_of(cfg: ModelConfig, pcfg: ParallelismConfig, seed: int = 5):
    plan = plan_stages(cfg.n_layers, pcfg)
    parts = [rank_part(cfg, plan, rank) for rank in range(pcfg.pp)]
    for part in parts:
        part.init_weights(seed)
    return plan, parts


@pytest.mark.parametrize(
    "schedule,virtual,n_layers,pp_layers",
    [
        ("1F1B", 1, 4, None),
        ("Interleaved1F1B", 2, 4, None),
        ("ZBVZeroBubble", 2, 4, None),
        ("1F1B", 1, 5, [3, 2]),  # uneven stage maps (parallelism.pp_layers)
        ("Interleaved1F1B", 2, 5, [1, 2, 1, 1]),
    ],
)
@torch.no_grad()
def test_parts_hold_their_stages_with_the_whole_models_names_values_and_forward(schedule, virtual, n_layers, pp_layers):
    cfg = tiny(n_layers=n_layers)
    whole = GPT(cfg)
    whole.init_weights(5)
    pcfg = ParallelismConfig(pp=2, pp_schedule=schedule, pp_virtual_stages=virtual, pp_layers=pp_layers)
    plan, parts = parts_of(cfg, pcfg)
    if pp_layers is not None:  # each stage holds the map's count of consecutive blocks
        assert [len(plan.layers[s]) for s in range(plan.n_stages)] == pp_layers
    full = dict(whole.named_parameters())
    names = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(names) == sorted(full)  # every parameter on exactly one rank, under its global name
    for part in parts:
        for name, p in part.named_parameters():
            assert torch.equal(p, full[name]), name
    stages = {s.stage_index: s for rank, part in enumerate(parts) for s in build_stages(part, plan, rank)}
    assert sorted(stages) == list(range(plan.n_stages))
    for rank, part in enumerate(parts):  # a stage shares its part's modules: no parameter of its own
        own = {id(p) for p in part.parameters()}
        for s in build_stages(part, plan, rank):
            assert {id(p) for p in s.parameters()} <= own
            assert s.rope is part.rope
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    h = tokens
    for s in range(plan.n_stages):
        h = stages[s](h)
    torch.testing.assert_close(h, whole(tokens), rtol=0, atol=0)
    # negative control: skipping the first stage's layers does not reproduce the whole model
    h = whole.tok_embeddings(tokens)
    for s in range(1, plan.n_stages):
        h = stages[s](h)
    assert h.shape == whole(tokens).shape and not torch.allclose(h, whole(tokens))


def test_a_part_without_embedding_or_head_has_none():
    cfg = tiny(tie_embeddings=False)
    middle = GPT(cfg, [1, 2], embedding=False, head=False)
    assert middle.tok_embeddings is None and middle.norm is None and middle.output is None
    assert list(middle.layers) == ["1", "2"]
    last = GPT(cfg, [3], embedding=False, head=True)
    assert sorted(n for n, _ in last.named_parameters() if not n.startswith("layers.")) == [
        "norm.weight",
        "output.weight",
    ]
