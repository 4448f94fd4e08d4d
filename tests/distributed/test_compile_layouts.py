"""torch.compile of the blocks under data and pipeline parallelism: the full entry point on 2 real ranks trains
with the same losses as eager (tensor parallelism + compile is refused by validation, see test_parallel_layout)."""
from __future__ import annotations

import json
import math

import pytest

from harness import run_ranks

pytestmark = pytest.mark.distributed


def losses(tmp_path, data_cache, layout, compile_blocks):
    name = f"{layout}-{'compiled' if compile_blocks else 'eager'}"
    argv = ["model=tiny", "model.seq_len=32", f"parallelism={layout}", "comm=cpu_gloo", "train.device=cpu",
            "train.threads=1", "train.max_steps=3", "train.micro_batch_size=2", "train.global_batch_size=4",
            "train.eval_every=0", "logging.every_steps=1", "logging.console=plain", "checkpoint.enabled=false",
            f"parallelism.compile={str(compile_blocks).lower()}", "~data.sources.code", "~data.sources.reference",
            f"run.root={tmp_path}", f"run.name={name}"]
    run_ranks("distributed.parallel_worker:train_entry", 2, {"argv": argv}, timeout=300,
              env={"LMFORGE_DATA_CACHE": str(data_cache)})
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("kind") == "train"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["fsdp", "pp2"])
def test_compiled_blocks_train_like_eager(tmp_path, data_cache, layout):
    eager = losses(tmp_path, data_cache, layout, False)
    compiled = losses(tmp_path, data_cache, layout, True)
    assert len(eager) == len(compiled) == 3 and all(math.isfinite(x) for x in compiled)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
