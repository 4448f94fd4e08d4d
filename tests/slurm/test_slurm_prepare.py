"""`lmforge data prepare --launcher slurm-array`: a 2-task array on the test cluster, byte-identical to a local run.

The submitter writes the plan, submits slurm/prepare_array.sh as a 2-task array (one task per node, --exclusive)
and a finalize job after it; the finalize job checks every shard and writes manifest.json. The shard files
and the manifest are compared byte for byte with a local preparation of the same inputs: shards cut by tokens
(--shard-size 8K) in the first test, by files in the second (a failed task, then a re-submission).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from lmforge.data.embedded import iter_documents
from lmforge.data.prepare import main as prepare_main

pytestmark = pytest.mark.slurm


def outputs(out: Path):
    return {
        p.name: p.read_bytes()
        for p in sorted(out.iterdir())
        if p.suffix in (".bin", ".idx") or p.name == "manifest.json"
    }


@pytest.mark.timeout(600)
def test_two_task_array_preparation_is_byte_identical_to_a_local_one(slurm_cluster, job_env, data_cache, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    docs = [d for _, d in zip(range(24), iter_documents("books"))]
    for i in range(6):
        (inputs / f"part-{i}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in docs[i * 4 : i * 4 + 4])
        )
    args = [str(inputs), "--shard-size", "8K", "--workers", "1", "--cache-dir", str(data_cache)]
    assert prepare_main([*args, "--out", str(tmp_path / "local")]) == 0

    out = tmp_path / "array"
    proc = slurm_cluster.client(
        [
            sys.executable,
            "-m",
            "lmforge.data.prepare",
            *args,
            "--out",
            str(out),
            "--launcher",
            "slurm-array",
            "--array-tasks",
            "2",
            "--sbatch-arg=--exclusive",
        ],
        cwd=tmp_path,
        env=job_env,
        timeout=120,
    )
    m = re.search(r"array job (\d+) \(2 tasks\) builds the shards of .*; job (\d+) checks them", proc.stdout)
    assert m, proc.stdout + proc.stderr
    array, final = m.groups()
    assert (out / "plan.json").exists() and not (out / "manifest.json").exists()
    try:
        slurm_cluster.wait_state(final, {"COMPLETED"}, timeout=400)
    except AssertionError as e:
        logs = "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((out / "logs").glob("*"))
        )
        raise AssertionError(f"{e}\n{logs}") from None
    task_logs = [(out / "logs" / f"prepare-{array}_{t}.out").read_text() for t in (0, 1)]
    hosts = [re.search(r"lmforge prepare: task (\d) of 2 on (\S+)", text).group(2) for text in task_logs]
    assert len(set(hosts)) == 2, hosts  # one task per node
    built = [json.loads(text[text.index("{") : text.index("}") + 1]) for text in task_logs]
    assert built == [{f"shard-{i:05d}": "built" for i in (0, 2, 4)}, {f"shard-{i:05d}": "built" for i in (1, 3, 5)}]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["shard_tokens"] == 8000 and len(manifest["shards"]) > 6
    assert outputs(out) == outputs(tmp_path / "local")  # byte-identical shards and manifest


@pytest.mark.timeout(600)
def test_a_failed_array_task_leaves_the_prefix_incomplete_and_resubmitting_resumes(
    slurm_cluster, job_env, data_cache, tmp_path
):
    inputs = tmp_path / "in"
    inputs.mkdir()
    docs = [d for _, d in zip(range(8), iter_documents("books"))]
    for i in range(4):
        (inputs / f"part-{i}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in docs[i * 2 : i * 2 + 2])
        )
    good = (inputs / "part-1.jsonl").read_text()
    bad = good.replace('{"text": ', '{"text"  ', 1)  # same size, not JSON: task 1 (shards 1, 3) fails on shard 1
    (inputs / "part-1.jsonl").write_text(bad)
    args = [str(inputs), "--shard-size", "1", "--workers", "1", "--cache-dir", str(data_cache)]
    out = tmp_path / "array"
    submit = [
        sys.executable,
        "-m",
        "lmforge.data.prepare",
        *args,
        "--out",
        str(out),
        "--launcher",
        "slurm-array",
        "--array-tasks",
        "2",
    ]

    def run_array():
        proc = slurm_cluster.client(submit, cwd=tmp_path, env=job_env, timeout=120)
        return re.search(r"array job (\d+) \(2 tasks\).*; job (\d+) checks them", proc.stdout).groups()

    array, final = run_array()
    slurm_cluster.wait_state(f"{array}_1", {"FAILED"}, timeout=300, fail_states=())
    slurm_cluster.wait_state(f"{array}_0", {"COMPLETED"}, timeout=300)
    slurm_cluster.wait_state(final, {"CANCELLED"}, timeout=120, fail_states=())  # afterok never satisfied
    err = (out / "logs" / f"prepare-{array}_1.err").read_text()
    assert f"lmforge data prepare: {inputs / 'part-1.jsonl'}:1: not valid JSON" in err, err
    assert not (out / "manifest.json").exists()
    assert sorted(p.name for p in out.glob("shard-*.meta.json")) == ["shard-00000.meta.json", "shard-00002.meta.json"]
    kept = {n: (out / n).stat().st_mtime_ns for n in ("shard-00000.bin", "shard-00002.bin")}

    (inputs / "part-1.jsonl").write_text(good)  # the input fixed (same size: the plan still matches)
    array, final = run_array()
    slurm_cluster.wait_state(final, {"COMPLETED"}, timeout=400)
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # finished shards were not redone
    assert prepare_main([*args, "--out", str(tmp_path / "local")]) == 0
    assert outputs(out) == outputs(tmp_path / "local")
