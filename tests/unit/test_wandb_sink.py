"""W&B sink: online without a key or without a reachable server falls back to offline with one warning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port

from lmforge.config.logging import WandbConfig
from lmforge.metrics.wandb_sink import WandbSink, resolve_mode


def test_resolve_mode_passes_offline_and_disabled_through():
    assert resolve_mode("offline", env={}) == ("offline", None)
    assert resolve_mode("disabled", env={}) == ("disabled", None)


def test_online_without_key_falls_back_to_offline(tmp_path):
    mode, warning = resolve_mode("online", env={"HOME": str(tmp_path)})
    assert mode == "offline"
    assert "no W&B API key" in warning and "wandb sync" in warning


def test_online_with_unreachable_server_falls_back_to_offline(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused at once
    mode, warning = resolve_mode(
        "online", env={"HOME": str(tmp_path), "WANDB_API_KEY": "fake-secret-0123456789", "WANDB_BASE_URL": closed}
    )
    assert mode == "offline" and "unreachable" in warning and "127.0.0.1" in warning
    # A name that does not resolve, and an address whose TLS certificate is not the server's.
    for url, where in (
        ("https://api.wandb.invalid", "api.wandb.invalid:443"),
        ("https://10.255.255.1", "10.255.255.1"),
    ):
        mode, warning = resolve_mode(
            "online",
            env={"HOME": str(tmp_path), "WANDB_API_KEY": "fake-secret-0123456789", "WANDB_BASE_URL": url},
            timeout=1.0,
        )
        assert mode == "offline" and where in warning, (url, warning)


@pytest.mark.timeout(120)
def test_sink_online_unreachable_logs_offline_run_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "fake-secret-wandb-key-1234567890")
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("HOME", str(tmp_path))
    warnings = []
    sink = WandbSink(
        WandbConfig(mode="online", project="p", group="g", tags=["a", "b"], name="n"),
        tmp_path / "wandb",
        {"model": {"d_model": 8}, "api_key": "fake-secret-wandb-key-1234567890"},
        run_id="fixedid1",
        warn=warnings.append,
    )
    assert sink.mode == "offline" and len(warnings) == 1
    for step in (1, 2):
        sink.log(
            {
                "kind": "train",
                "step": step,
                "loss": 3.0 - step,
                "mfu": 0.25,
                "tokens_seen": 64 * step,
                "flops_seen": 1000 * step,
            }
        )
    sink.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*-fixedid1"))
    assert len(runs) == 1
    out = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(runs[0])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    run = next(r["run"] for r in records if r.get("type") == "run")
    assert (run["run_id"], run["run_group"], run["tags"], run["display_name"]) == ("fixedid1", "g", ["a", "b"], "n")
    assert run["config"]["update"]["api_key"] == "***REDACTED***"
    history = [r["history"]["item"] for r in records if r.get("type") == "history"]
    assert [(h["train/loss"], h["train/mfu"], h["tokens_seen"]) for h in history] == [(2, 0.25, 64), (1, 0.25, 128)]
    axes = {r["metric"].get("glob_name"): r["metric"].get("step_metric") for r in records if r.get("type") == "metric"}
    assert axes["train/*"] == "tokens_seen" and axes["val/*"] == "tokens_seen"
    assert "fake-secret" not in out.stdout


@pytest.mark.timeout(120)
def test_fault_events_reach_wandb_as_counted_series(tmp_path, monkeypatch):
    """Restart, skipped-step and straggler events become events/<name> series in the run (read back offline)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    sink = WandbSink(WandbConfig(mode="offline", project="p"), tmp_path / "wandb", {}, run_id="faults1")
    sink.log({"kind": "train", "step": 1, "loss": 2.0, "tokens_seen": 64})
    sink.event({"kind": "event", "event": "skipped_step", "step": 2, "rank": 0, "cause": "loss is nan"})
    sink.event({"kind": "event", "event": "skipped_step", "step": 3, "rank": 0, "cause": "loss is nan"})
    sink.event({"kind": "event", "event": "straggler", "step": 3, "rank": 1, "cause": "2.1x median step time"})
    sink.close()
    run_dir = next((tmp_path / "wandb").glob("offline-run-*-faults1"))
    out = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    history = [
        json.loads(line)["history"]["item"]
        for line in out.stdout.splitlines()
        if line.startswith("{") and json.loads(line).get("type") == "history"
    ]
    skipped = [h["events/skipped_step"] for h in history if "events/skipped_step" in h]
    stragglers = [h["events/straggler"] for h in history if "events/straggler" in h]
    assert skipped[-1] == 2 and stragglers == [1], history
