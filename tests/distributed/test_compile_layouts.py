"""torch.compile of the blocks under data and pipeline parallelism: the full entry point on 2 real ranks trains
with the same losses as eager (tensor parallelism + compile is refused by validation, see test_parallel_layout).
The eager and the compiled training of a layout share one launch of the ranks (train_entries), eager first.
The fsdp launch also trains the Mixture-of-Experts model (parity_cases.MOE: capacity drops, bias update) with
expert parallelism ep=2, eager then compiled: the same losses, router losses and expert-load metrics."""

from __future__ import annotations

import json
import math

import pytest
from harness import run_ranks
from parity_cases import MOE

EP2 = MOE + ["parallelism.ep=2"]
MOE_METRICS = ("moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean", "moe/dropped")


def argv(tmp_path, layout, compile_blocks, extra=()):
    return [
        *extra,
        "model=tiny",
        "model.seq_len=32",
        f"parallelism={layout}",
        "comm=cpu_gloo",
        "train.device=cpu",
        "train.threads=1",
        "train.max_steps=3",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.eval_every=0",
        "logging.every_steps=1",
        "logging.console=plain",
        "checkpoint.enabled=false",
        f"parallelism.compile={str(compile_blocks).lower()}",
        "~data.sources.code",
        "~data.sources.reference",
        f"run.root={tmp_path}",
        f"run.name={run_name(layout, compile_blocks, extra)}",
    ]


def run_name(layout, compile_blocks, extra=()):
    return f"{layout}{'-moe-ep2' if extra else ''}-{'compiled' if compile_blocks else 'eager'}"


def train_records(tmp_path, layout, compile_blocks, extra=()):
    path = tmp_path / run_name(layout, compile_blocks, extra) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r.get("kind") == "train"]


def losses(tmp_path, layout, compile_blocks):
    return [r["loss"] for r in train_records(tmp_path, layout, compile_blocks)]


pytestmark = pytest.mark.distributed


@pytest.mark.timeout(960)
@pytest.mark.parametrize("layout", ["fsdp", "pp2"])
def test_compiled_blocks_train_like_eager(tmp_path, data_cache, layout):
    argvs = [argv(tmp_path, layout, False), argv(tmp_path, layout, True)]
    if layout == "fsdp":
        argvs += [argv(tmp_path, layout, False, EP2), argv(tmp_path, layout, True, EP2)]
    run_ranks(
        "distributed.train_entries:train_entries",
        2,
        {"argvs": argvs},
        timeout=900,
        env={"LMFORGE_DATA_CACHE": str(data_cache)},
    )
    eager, compiled = losses(tmp_path, layout, False), losses(tmp_path, layout, True)
    assert len(eager) == len(compiled) == 3 and all(math.isfinite(x) for x in compiled)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
    if layout == "fsdp":
        eager, compiled = (train_records(tmp_path, layout, c, EP2) for c in (False, True))
        keys = ("loss",) + MOE_METRICS
        assert len(eager) == len(compiled) == 3 and all(k in r for r in eager for k in keys)
        assert any(r["moe/dropped"] > 0 for r in eager)  # the capacity limit acts
        assert [r[k] for r in compiled for k in keys] == pytest.approx(
            [r[k] for r in eager for k in keys], rel=1e-5, abs=1e-6
        )
