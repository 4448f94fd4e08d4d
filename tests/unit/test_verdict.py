"""Verdict files (fault/verdict.py) and the retry decision that reads them (single process)."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from lmforge.checkpoint.safe_io import UnsafeCheckpointError
from lmforge.config.errors import ConfigError
from lmforge.fault import verdict as V
from lmforge.fault.hooks import Corrupted, Diverged
from lmforge.fault.retry import record
from lmforge.runtime.device_contract import DeviceContractError


def test_kinds_exit_codes_and_what_is_deterministic(tmp_path):
    cases = {
        ConfigError("parallelism", "layout 4 but world size 2"): ("layout_error", 2),
        ConfigError("parallelism.tp", "n_heads not divisible"): ("layout_error", 2),
        ConfigError("data.sources.web.prefix", "no Megatron shard"): ("data_error", 2),
        ConfigError("model.vocab_size", "too small"): ("config_error", 2),
        Diverged("training diverged: 2 skipped steps"): ("diverged", 45),
        DeviceContractError("rank 0 on node1: cluster h100_node wants cuda, torch has none"): ("config_error", 2),
        UnsafeCheckpointError("ckpt/.metadata", "refused global os.system"): ("config_error", 2),
        Corrupted("replicas differ at step 4"): ("corrupted", 47),
        ValueError("boom"): ("crash", 1),
        # a BaseException that is not an Exception: a failed DCP save or load still leaves a crash verdict
        CheckpointException("save", {0: (RuntimeError("disk full"), traceback.extract_stack())}): ("crash", 1),
    }
    for exc, (kind, code) in cases.items():
        got, got_code, message = V.classify(exc)
        assert (got.value, got_code) == (kind, code), exc
        assert message
    assert V.classify(SystemExit(0)) is None and V.classify(KeyboardInterrupt()) is None
    assert V.classify(GeneratorExit()) is None
    assert {k.value for k in V.DETERMINISTIC} == {
        "config_error",
        "layout_error",
        "data_error",
        "diverged",
        "repeated_crash",
        "corrupted",
    }
    assert not V.VerdictKind.CRASH.deterministic and not V.VerdictKind.HANG.deterministic


def test_recorder_writes_atomically_reraises_and_archive_moves_to_history(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ConfigError):
        with V.VerdictRecorder(tmp_path) as rec:
            rec.step = lambda: 7
            raise ConfigError("model.vocab_size", "too small", "raise it")
    d = tmp_path / "verdicts"
    assert sorted(p.name for p in d.iterdir()) == ["rank3.json"]  # no temporary file left
    v = json.loads((d / "rank3.json").read_text())
    assert (v["kind"], v["rank"], v["step"], v["exit_code"], v["deterministic"]) == ("config_error", 3, 7, 2, True)
    assert V.deciding(tmp_path).summary().startswith("config_error on rank 3 at step 7 (exit 2): config key")
    assert V.archive(tmp_path) == 1
    assert V.read_all(tmp_path) == [] and V.deciding(tmp_path) is None
    assert json.loads((d / "history.jsonl").read_text())["kind"] == "config_error"


def test_secret_values_never_reach_a_verdict_or_a_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "sekrit-123456")
    v = V.verdict_for(tmp_path, ValueError("bad key sekrit-123456"), rank=0, step=1, started=time.time())
    files = [tmp_path / "verdicts" / "rank0.json", *map(Path, v.tracebacks)]
    assert all("sekrit-123456" not in f.read_text() and "REDACTED" in f.read_text() for f in files)


def test_repeated_crash_needs_the_same_step_and_error_from_an_earlier_attempt(tmp_path):
    first = V.verdict_for(tmp_path, RuntimeError("x"), rank=1, step=5, started=time.time())
    assert first.kind is V.VerdictKind.CRASH and len(first.tracebacks) == 1
    # Same attempt (the record is newer than this worker's start): a peer's crash, not a repeat.
    same = V.verdict_for(tmp_path, RuntimeError("x"), rank=0, step=5, started=time.time() - 60)
    assert same.kind is V.VerdictKind.CRASH
    later = time.time() + 1
    assert V.verdict_for(tmp_path, RuntimeError("x"), 1, 6, later).kind is V.VerdictKind.CRASH  # other step
    assert V.verdict_for(tmp_path, KeyError("x"), 1, 5, later).kind is V.VerdictKind.CRASH  # other error
    again = V.verdict_for(tmp_path, RuntimeError("x"), 1, 5, later)
    assert again.kind is V.VerdictKind.REPEATED_CRASH and again.exit_code == 46 and again.deterministic
    assert "-rank1-" in again.tracebacks[0] and len(again.tracebacks) == 2  # this rank's earlier crash first
    assert all("RuntimeError: x" in open(p).read() for p in again.tracebacks)


def test_retry_stops_on_a_deterministic_verdict_and_retries_a_crash(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = tmp_path / "run"
    V.write(run, V.Verdict(V.VerdictKind.CRASH, 0, 4, "RuntimeError: x", 1))
    assert record(run, 1, signalled=False, max_failures=2).action == "requeue"  # negative control: retryable
    V.write(run, V.Verdict(V.VerdictKind.DIVERGED, 1, 9, "training diverged", 45))
    d = record(run, 1, signalled=False, max_failures=2)  # torchrun's exit 1: the verdict, not the code, decides
    assert (d.action, d.kind, d.exit_code) == ("stop", "diverged", 45)
    assert d.reason.startswith("diverged on rank 1 at step 9 (exit 45): training diverged; not retried")
    state = json.loads((run / "requeues.json").read_text())
    assert state["failures"] == 1 and [v["kind"] for v in state["history"][-1]["verdicts"]] == ["crash", "diverged"]
    V.archive(run)
    assert (
        record(run, 2, signalled=False, max_failures=2).action == "stop"
    )  # exit 2 without a verdict: bad input, never retried
