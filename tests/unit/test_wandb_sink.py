"""W&B sink: online without a key or without a reachable server falls back to offline with one warning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import free_port
from wandb_read import history, leet

from lmforge.config.errors import ActionableError
from lmforge.config.logging import WandbConfig
from lmforge.metrics.series import EventCounter
from lmforge.metrics.wandb_sink import WandbSink, make_wandb_sink, resolve_mode


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
    assert axes["*"] == "trainer/step" and [h["trainer/step"] for h in history] == [1, 2]
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


def test_auto_mode_follows_wandb_mode_then_the_key(tmp_path):
    home = {"HOME": str(tmp_path)}
    # No key anywhere: offline, in one line naming the sync command for this run's files.
    mode, line = resolve_mode("auto", env=home, sync_path="/r/wandb/offline-run-*-abc")
    assert mode == "offline" and "no W&B API key" in line and "`wandb sync /r/wandb/offline-run-*-abc`" in line
    assert "\n" not in line
    # W&B's own WANDB_MODE wins (the test suite sets disabled); a value W&B does not know is refused by name.
    assert resolve_mode("auto", env={**home, "WANDB_MODE": "disabled"}) == ("disabled", None)
    mode, line = resolve_mode("auto", env={**home, "WANDB_MODE": "dryrun"})
    assert mode == "offline" and "WANDB_MODE=dryrun" in line and "wandb sync" in line
    with pytest.raises(ActionableError) as e:
        resolve_mode("auto", env={**home, "WANDB_MODE": "onlin"})
    assert str(e.value).startswith("environment variable WANDB_MODE: 'onlin' is not a W&B mode")
    # A key in each place W&B looks makes auto go online: here the server is closed, so the online fallback
    # says so (it found the key), and the key itself is never in the line.
    closed = f"http://127.0.0.1:{free_port()}"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1\n  login user\n  password fake-secret-netrc-0123456789\n")
    netrc.chmod(0o600)
    settings = tmp_path / "wandb-config"
    settings.mkdir()
    (settings / "settings").write_text("[default]\napi_key = fake-secret-settings-0123456789\n")
    for where in (
        {"WANDB_API_KEY": "fake-secret-env-0123456789"},
        {"NETRC": str(netrc)},
        {"WANDB_CONFIG_DIR": str(settings)},
    ):
        mode, line = resolve_mode("auto", env={**home, "WANDB_BASE_URL": closed, **where})
        assert mode == "offline" and "unreachable" in line and "fake-secret" not in line, (where, line)
    # Without any of them, the same server is never probed: offline for want of a key.
    mode, line = resolve_mode("auto", env={**home, "WANDB_BASE_URL": closed})
    assert "no W&B API key" in line


def test_the_suite_runs_with_wandb_off_unless_a_test_asks(tmp_path, monkeypatch, capsys):
    import os

    assert os.environ.get("WANDB_MODE") == "disabled"  # tests/conftest.py, inherited by every process it starts
    assert WandbConfig().mode == "auto"
    assert make_wandb_sink(WandbConfig(), tmp_path / "wandb", config={}, run_id="x") is None
    assert not (tmp_path / "wandb").exists() and capsys.readouterr().err == ""


@pytest.mark.timeout(120)
def test_auto_without_a_key_logs_offline_and_says_how_to_sync(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    sink = make_wandb_sink(WandbConfig(project="p"), tmp_path / "wandb", config={}, run_id="auto1")
    sink.log({"kind": "train", "step": 1, "loss": 2.0, "tokens_seen": 64})
    sink.close()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("lmforge: W&B logging offline (logging.wandb.mode=auto and no W&B API key")
    assert line.endswith(f"Sync later with `wandb sync {tmp_path / 'wandb'}/offline-run-*-auto1*`")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*-auto1")
    assert [h["train/loss"] for h in history(leet(run_dir))] == [2]


# One training run as a restarted job logs it: the first launch reaches step 5 and checkpoints at step 3, the
# second resumes from that checkpoint and logs steps 3..6 again after its resume event.
FIRST = [("train", 1), ("train", 2), ("checkpoint_commit", 3), ("train", 3), ("train", 4), ("train", 5)]
SECOND = [("resume", 3), ("train", 3), ("train", 4), ("train", 5), ("train", 6)]


def feed(sink, entries, launch: int) -> None:
    for kind, step in entries:
        if kind == "train":
            sink.log({"kind": "train", "step": step, "loss": 10.0 * launch + step, "tokens_seen": 64 * step})
        else:
            sink.event({"kind": "event", "event": kind, "step": step, "rank": 0, "write_s": 0.5})


def expected_rows() -> list:
    rows = []
    for launch, entries in ((1, FIRST), (2, SECOND)):
        for kind, step in entries:
            rows.append((step, f"loss {10 * launch + step}" if kind == "train" else kind))
    return rows


def logged_rows(items: list) -> list:
    """(trainer step, what) for each record a history row holds (one row may hold several)."""
    rows = []
    for h in items:
        if "checkpoint/write_s" in h:
            rows.append((h["trainer/step"], "checkpoint_commit"))
        if "events/resume" in h:
            rows.append((h["trainer/step"], "resume"))
        if "train/loss" in h:
            rows.append((h["trainer/step"], f"loss {h['train/loss']:g}"))
    return rows


@pytest.mark.timeout(180)
def test_a_resumed_launch_keeps_every_row_of_the_redone_steps(tmp_path, monkeypatch):
    """Two sink lifetimes on one W&B run id, the second starting below the first's last step: every row of both
    survives in W&B's own files, with its trainer/step, and no log call passes a step (W&B numbers the rows)."""
    import wandb

    monkeypatch.setenv("HOME", str(tmp_path))
    calls = []
    real_log = wandb.Run.log

    def recording_log(self, data, *args, **kwargs):
        calls.append((dict(data), args, kwargs))
        return real_log(self, data, *args, **kwargs)

    monkeypatch.setattr(wandb.Run, "log", recording_log)
    for launch, entries in ((1, FIRST), (2, SECOND)):
        sink = WandbSink(WandbConfig(mode="offline", project="p"), tmp_path / "wandb", {}, run_id="resume1")
        feed(sink, entries, launch)
        sink.close()
    assert len(calls) == len(FIRST) + len(SECOND)
    assert all(not args and "step" not in kwargs for _, args, kwargs in calls), calls
    runs = sorted((tmp_path / "wandb").glob("offline-run-*-resume1*"))  # one per launch, in start order
    assert len(runs) == 2
    rows = [row for run_dir in runs for row in logged_rows(history(leet(run_dir)))]
    assert rows == expected_rows()
    metrics = [r["metric"] for r in leet(runs[1]) if r.get("type") == "metric"]
    assert {"glob_name": "*", "step_metric": "trainer/step"}.items() <= next(
        m for m in metrics if m.get("glob_name") == "*"
    ).items()


@pytest.mark.timeout(120)
def test_logging_at_the_trainer_step_loses_the_redone_rows(tmp_path, monkeypatch):
    """Negative control: the same rows logged with step=<trainer step> into a run whose step has reached the first
    launch's last step (what an online resume continues) lose the resume event and the redone steps 3 and 4, and
    step 5 of the second launch overwrites the first launch's (rows at one step are merged)."""
    import wandb

    monkeypatch.setenv("HOME", str(tmp_path))
    run = wandb.init(
        mode="offline",
        dir=str(tmp_path),
        project="p",
        id="oldsteps",
        settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True),
    )

    class StepSink(WandbSink):  # the rows of WandbSink, at step=<trainer step> as W&B's own step
        def __init__(self):
            self.run, self.mode, self._events = run, "offline", EventCounter()

        def _log(self, row, record):
            run.log(row, step=int(record["step"]))

    for launch, entries in ((1, FIRST), (2, SECOND)):
        feed(StepSink(), entries, launch)
    run.finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*-oldsteps")
    kept = []
    for h in history(leet(run_dir)):
        h["trainer/step"] = h["_step"]
        kept += logged_rows([h])
    lost = [row for row in expected_rows() if row not in kept]
    assert lost == [(5, "loss 15"), (3, "resume"), (3, "loss 23"), (4, "loss 24")], kept


@pytest.mark.timeout(120)
def test_a_sweep_point_is_grouped_with_its_n_d_c_in_the_run_config(tmp_path, monkeypatch):
    """A planned point's own overrides, composed as `lmforge train` does, give the W&B run the sweep's group and
    sweep.N / sweep.D / sweep.C equal to the plan's numbers."""
    from lmforge.config.compose import compose
    from lmforge.config.record import config_dict
    from lmforge.scaling.plan import Rules, plan
    from lmforge.scaling.shapes import ShapeFamily

    monkeypatch.setenv("HOME", str(tmp_path))
    family = ShapeFamily(
        head_dim=8, aspect_min=8, aspect_max=64, max_width=128, min_layers=1, max_layers=4, vocab_size=512, seq_len=64
    )
    sweep = plan("wbsweep", [1e10], family, Rules(tpp_min=0.5, tpp_max=100), str(tmp_path / "runs"))
    p = sweep.points[0]
    cfg = compose(p.overrides)
    sink = make_wandb_sink(
        WandbConfig(mode="offline", project="p"),
        tmp_path / "wandb",
        config=config_dict(cfg),
        run_id="point1",
        group=cfg.run.sweep_name,
    )
    sink.close()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*-point1")
    run = next(r["run"] for r in leet(run_dir) if r.get("type") == "run")
    assert run["run_group"] == "wbsweep"
    block = run["config"]["update"]["sweep"]
    assert (block["N"], block["D"], block["C"]) == (p.n_flops, float(p.tokens), p.planned_flops)
    assert (block["name"], block["point"]) == ("wbsweep", p.sweep_point)
