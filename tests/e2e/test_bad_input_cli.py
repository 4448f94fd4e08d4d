"""Every bad input through the CLI (`python -m lmforge.cli train ...`): exit 2, one line naming the key/file/rank,
the reason and the fix on stderr, no traceback, and nothing written outside the run directory."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.data.embedded import iter_documents
from lmforge.data.indexed_shard import HEADER_BYTES
from lmforge.data.prepare import prepare
from lmforge.data.tokenizer import load_tokenizer, train_bpe

REPO = Path(__file__).resolve().parents[2]
EXPS = ", ".join(
    sorted(p.stem for p in (REPO / "conf" / "exp").glob("*.yaml"))
)  # every preset, as the error lists them
BASE = [
    "model=tiny",
    "train.max_steps=1",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_every=0",
    "train.threads=1",
    "train.device=cpu",
    "logging.console=plain",
]
ONE_SOURCE = ["~data.sources.code", "~data.sources.reference"]


def cli(args, root, name, env=None, timeout=240):
    cmd = [sys.executable, "-m", "lmforge.cli", "train", *BASE, *args, f"run.root={root}", f"run.name={name}"]
    return subprocess.run(
        cmd, cwd=root, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def snapshot(*dirs, skip=None):
    out = {}
    for d in dirs:
        for p in Path(d).rglob("*"):
            if skip is not None and (p == skip or skip in p.parents):
                continue
            st = p.lstat()
            out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, data_cache):
    """A real 1-step checkpoint, damaged copies of it, shards (good, damaged, other tokenizer), a bad conf tree."""
    root = tmp_path_factory.mktemp("bad-inputs")
    proc = cli([], root, "base")
    assert proc.returncode == 0, proc.stderr[-3000:]
    good = root / "base" / "checkpoints" / "step-00000001"
    broken = root / "broken" / "checkpoints"
    shutil.copytree(good, broken / ".tmp-step-00000002")
    (broken / ".tmp-step-00000002" / "COMPLETE").unlink()
    shutil.copytree(good, broken / "step-00000001")
    (broken / "step-00000001" / "__0_0.distcp").unlink()
    chapters = [d for _, d in zip(range(60), iter_documents("books"))]
    jsonl = root / "books.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in chapters))
    tok = load_tokenizer("embedded", data_cache)
    small = train_bpe(chapters[:10], 600, root / "small" / "tokenizer.json")
    shards = root / "shards"
    prepare([str(jsonl)], shards / "books", tok)
    prepare([str(jsonl)], shards / "other_tok", load_tokenizer(str(small)))
    for name in ("truncated", "badidx"):
        for ext in ("bin", "idx", "meta.json"):
            shutil.copy(shards / f"books.{ext}", shards / f"{name}.{ext}")
    with open(shards / "truncated.bin", "r+b") as fh:
        fh.truncate((shards / "books.bin").stat().st_size - 10)
    raw = bytearray((shards / "badidx.idx").read_bytes())
    (first,) = struct.unpack_from("<i", raw, HEADER_BYTES)
    struct.pack_into("<i", raw, HEADER_BYTES, first - 3)  # the first document's length, 3 tokens too few
    (shards / "badidx.idx").write_bytes(bytes(raw))
    conf = root / "conf"
    shutil.copytree(REPO / "conf", conf)
    (conf / "exp" / "bad.yaml").write_text("# @package _global_\ntrain:\n  max_steps: lots\n")
    return {"root": root, "good": good, "broken": broken, "small": small, "shards": shards, "conf": conf}


def _rows(i):
    good, broken, shards, small, conf = i["good"], i["broken"], i["shards"], i["small"], i["conf"]
    fresh = "or start a new run (train.resume=none, or another run.name)"
    sh = lambda name: [f"data.sources.books.path={shards / name}", *ONE_SOURCE]  # noqa: E731
    idx_bytes = (shards / "books.bin").stat().st_size
    bin_tokens = idx_bytes // 2
    prep_fix = "re-run `lmforge data prepare INPUTS --out PREFIX` (see docs/data.md)"
    tok = load_tokenizer("embedded", Path(os.environ["LMFORGE_DATA_CACHE"])).identity
    other = load_tokenizer(str(small)).identity
    desc = lambda t: (
        f"hf tokenizer (vocab {t['vocab_size']}, eod {t['eod']}, "  # noqa: E731
        f"fingerprint {t['fingerprint']})"
    )
    return {
        "tp2_single_process": (
            ["parallelism=tp2"],
            {},
            "config key 'parallelism': dp_replicate*dp_shard*tp*pp = 1*1*2*1 = 2 but the job has world size 1. "
            "Fix: start 2 processes: lmforge launch --nproc 2 <same overrides> (torchrun --nproc_per_node=2 -m "
            "lmforge.train <same overrides>), or choose a layout of 1 (parallelism=single)",
        ),
        "vocab_smaller_than_tokenizer": (
            ["model.vocab_size=100"],
            {},
            "config key 'model.vocab_size': 100 is smaller than the tokenizer's vocabulary (8192, embedded). "
            "Fix: set model.vocab_size >= 8192",
        ),
        "deepspeed_compile": (
            ["parallelism.engine=deepspeed", "parallelism.zero_stage=1", "parallelism.compile=true"],
            {},
            "config key 'parallelism.compile': the deepspeed engine runs the model eagerly (it never calls "
            "torch.compile), so compile=true would be silently ignored. Fix: set parallelism.compile=false, or use "
            "parallelism.engine=native to compile",
        ),
        "resume_nothing": (
            [f"train.resume={i['root'] / 'nonexistent'}"],
            {},
            f"config key 'train.resume': {i['root'] / 'nonexistent'} does not exist. Fix: point at a step-NNNNNNNN "
            "checkpoint directory (or the checkpoints/ directory holding it), or use train.resume=auto (the newest "
            "of this run) or train.resume=none",
        ),
        "resume_tmp_dir": (
            [f"train.resume={broken / '.tmp-step-00000002'}"],
            {},
            f"config key 'train.resume': {broken / '.tmp-step-00000002'} is an uncommitted save (a .tmp-step-* "
            "directory is a save that never finished; its shards may be partial). Fix: resume from a complete "
            f"checkpoint: train.resume={broken / 'step-00000001'}",
        ),
        "resume_other_shape": (
            [f"train.resume={good}", "model.d_model=128"],
            {},
            f"config key 'train.resume': checkpoint {good} is of another model shape: it was saved with "
            f"model.d_model=64 (this run: 128). Fix: resume with the checkpoint's model (model.d_model=64) {fresh}",
        ),
        "resume_other_vocab": (
            [f"train.resume={good}", "model.vocab_size=9000"],
            {},
            f"config key 'train.resume': checkpoint {good} is of another vocabulary: it was saved with "
            f"model.vocab_size=8192 (this run: 9000). Fix: resume with the checkpoint's model (model.vocab_size=8192) "
            f"{fresh}",
        ),
        "resume_other_tokenizer": (
            [f"train.resume={good}", f"data.tokenizer={small}"],
            {},
            f"config key 'train.resume': checkpoint {good} was trained with a hf tokenizer (vocab 8192, fingerprint "
            f"{tok['fingerprint']}), this run's data.tokenizer has vocab 600, fingerprint {other['fingerprint']}. "
            f"Fix: set data.tokenizer to the checkpoint's tokenizer {fresh}",
        ),
        "resume_missing_rank_shard": (
            [f"train.resume={broken / 'step-00000001'}"],
            {},
            f"config key 'train.resume': checkpoint {broken / 'step-00000001'} is missing __0_0.distcp (rank 0's "
            "shard, listed in its .metadata): the checkpoint is incomplete. Fix: restore the file, resume from "
            f"another complete checkpoint {fresh}",
        ),
        "truncated_bin": (
            sh("truncated"),
            {},
            f"config key 'data.sources.books.path': {shards / 'truncated.bin'} has {idx_bytes - 10} bytes but "
            f"truncated.idx describes {idx_bytes} ({bin_tokens} tokens of uint16): the shard is truncated. "
            f"Fix: {prep_fix}",
        ),
        "idx_disagrees_with_bin": (
            sh("badidx"),
            {},
            f"config key 'data.sources.books.path': {shards / 'badidx.bin'} has {idx_bytes} bytes but badidx.idx "
            f"describes {idx_bytes - 6} ({bin_tokens - 3} tokens of uint16): the shard is longer than its index "
            f"(corrupt). Fix: {prep_fix}",
        ),
        "shard_of_other_tokenizer": (
            sh("other_tok"),
            {},
            f"config key 'data.sources.books.path': shard {shards / 'other_tok'} was tokenized with {desc(other)}, "
            f"but this run's tokenizer (data.tokenizer) is {desc(tok)}. Fix: re-prepare the shard with the run's "
            "tokenizer (lmforge data prepare --tokenizer ...), or set data.tokenizer to the one the shard was made "
            "with",
        ),
        "yaml_wrong_type": (
            ["+exp=bad"],
            {"LMFORGE_CONF_DIR": str(conf)},
            f"config key 'train.max_steps': Value 'lots' of type 'str' could not be converted to Integer (in "
            f"{conf / 'exp' / 'bad'}.yaml). Fix: give a value of the schema's type",
        ),
        "document_flex_on_cpu": (
            ["data.document_masking=true", "data.document_attention=flex", "train.device=cpu"],
            {},
            "config key 'data.document_attention': flex cannot train on the CPU: torch's FlexAttention has no "
            "backward there. Fix: use data.document_attention=sdpa on the CPU (flex needs CUDA)",
        ),
        "eval_task_missing": (
            ["eval.tasks=[nope.yaml]"],
            {},
            "config key 'eval.tasks': nope.yaml: no such task file. Fix: give the path of an lm-eval task YAML, or a "
            "shipped task: austen_next_sentence, austen_word_order, stdlib_next_line",
        ),
        "unknown_exp": (
            ["+exp=smok"],
            {},
            f"config key 'exp': 'smok' is not one of {EXPS} (no exp/smok.yaml in "
            f"{REPO / 'conf'}). Fix: did you mean 'smoke'? choose one of {EXPS}",
        ),
    }


ROWS = [
    "tp2_single_process",
    "vocab_smaller_than_tokenizer",
    "deepspeed_compile",
    "resume_nothing",
    "resume_tmp_dir",
    "resume_other_shape",
    "resume_other_vocab",
    "resume_other_tokenizer",
    "resume_missing_rank_shard",
    "truncated_bin",
    "idx_disagrees_with_bin",
    "shard_of_other_tokenizer",
    "yaml_wrong_type",
    "unknown_exp",
    "document_flex_on_cpu",
    "eval_task_missing",
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("row", ROWS)
def test_bad_input_exits_2_with_one_line(row, inputs, data_cache, tmp_path):
    args, env, line = _rows(inputs)[row]
    before = snapshot(inputs["root"], data_cache, tmp_path)
    proc = cli(args, tmp_path, "run", env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("lmforge:")]
    assert ours == [f"lmforge: {line}"], proc.stderr[-3000:]
    assert snapshot(inputs["root"], data_cache, tmp_path, skip=tmp_path / "run") == before


@pytest.mark.timeout(600)
def test_control_a_matching_checkpoint_and_good_shard_resume_and_train(inputs, tmp_path):
    """Negative control: the same entry point with the undamaged checkpoint and shard trains on (exit 0)."""
    proc = cli(
        [
            f"train.resume={inputs['good']}",
            "train.max_steps=2",
            f"data.sources.books.path={inputs['shards'] / 'books'}",
            "data.valid_fraction=0.1",
            *ONE_SOURCE,
        ],
        tmp_path,
        "run",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 1" in proc.stdout
    assert (tmp_path / "run" / "checkpoints" / "step-00000002" / "COMPLETE").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [["--nproc", "2"], ["--slurm", "--nodes", "2"]])
def test_launch_names_a_bad_key_in_one_line_before_starting_or_submitting(mode, tmp_path):
    """``lmforge launch`` (local torchrun or sbatch) validates the config first, like ``train``: a typo is one line
    and exit 2 (it was a ConfigError traceback and exit 1), and nothing is started, submitted or written."""
    cmd = [sys.executable, "-m", "lmforge.cli", "launch", *mode, *BASE, "trian.max_steps=3", f"run.root={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "lmforge launch: config key 'trian': is not a known key. Fix: did you mean 'train'?"
    ], proc.stderr[-2000:]
    assert not any(tmp_path.iterdir())
