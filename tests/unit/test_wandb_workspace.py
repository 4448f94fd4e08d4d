"""``lmforge wandb workspace`` (metrics/wandb_workspace.py) with W&B's own workspace API: the view captured at the
library's upload call, round-tripped through the library, and every panel's series a name the sinks log. No W&B
server is reached here: that the service accepts and renders the view is not exercised (docs/metrics.md). Which
series a real run logs: the smoke run (tests/e2e/test_smoke.py) and the 2-rank overlap run
(tests/distributed/test_comm.py) read their offline W&B runs back against ``panel_series``."""

from __future__ import annotations

import json

import pytest
import wandb_workspaces.workspaces as ws
from wandb_workspaces.workspaces import internal

from lmforge.cli import main as lmforge
from lmforge.metrics.series import record_row
from lmforge.metrics.wandb_workspace import PANELS, build_workspace, panel_series, unmatched, view_json


@pytest.fixture
def uploads(monkeypatch):
    """The views the library would send to W&B, captured at its upload call (no network)."""
    sent = []

    def upsert_view2(view):
        sent.append(view)
        return {"upsertView": {"view": {"name": "v1", "id": "id1"}}}

    class Api:
        default_entity = "team"

    monkeypatch.setattr(internal, "upsert_view2", upsert_view2)
    monkeypatch.setattr("wandb.Api", Api)
    monkeypatch.setattr(ws.Workspace, "url", property(lambda self: f"https://wandb.example/{self._internal_name}"))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    return sent


def test_the_command_saves_the_workspace_through_the_librarys_upload(uploads, capsys):
    assert lmforge(["wandb", "workspace", "--project", "lmforge"]) == 0
    (view,) = uploads
    assert (view.entity, view.project, view.display_name) == ("team", "lmforge", "lmforge runs")
    assert capsys.readouterr().out.strip() == (
        "lmforge: workspace 'lmforge runs' (7 sections, 17 panels) saved: https://wandb.example/v1"
    )
    spec = json.loads(view.spec.model_dump_json(by_alias=True, exclude_none=True))
    again = ws.Workspace._from_model(view)._to_model().spec  # the library reads its own view back the same
    assert json.loads(again.model_dump_json(by_alias=True, exclude_none=True)) == spec
    titles = [p.title for s in ws.Workspace._from_model(view).sections for p in s.panels]
    assert titles == [title for panels in PANELS.values() for title, _, _ in panels]


def test_without_a_key_it_refuses_in_one_line_and_out_writes_the_same_view(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert lmforge(["wandb", "workspace", "--project", "lmforge"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("Fix: wandb login, or --out FILE to write the view without saving it")
    out = tmp_path / "ws.json"
    assert lmforge(["wandb", "workspace", "--project", "lmforge", "--entity", "team", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    built = view_json(build_workspace("lmforge", "team", "lmforge runs"))  # panel ids are drawn anew each build
    assert {k: written[k] for k in ("entity", "project", "name")} == {
        "entity": "team",
        "project": "lmforge",
        "name": "lmforge runs",
    }
    assert strings(written["spec"], "chartTitle") == strings(built["spec"], "chartTitle")
    assert strings(written["spec"], "chartTitle") >= {title for panels in PANELS.values() for title, _, _ in panels}


def strings(tree, key: str) -> set:
    """Every string value of ``key`` anywhere in a JSON tree."""
    if isinstance(tree, dict):
        here = {tree[key]} if isinstance(tree.get(key), str) else set()
        return here.union(*(strings(v, key) for v in tree.values()))
    if isinstance(tree, list):
        return set().union(*(strings(v, key) for v in tree))
    return set()


def test_every_panel_plots_series_the_sinks_name_so():
    """A record of each kind through the sinks' naming (metrics/series.py) covers every panel's series."""
    records = [
        {"kind": "train", "step": 1, "loss": 1, "lr": 1, "grad_norm": 1, "tokens_per_s": 1, "mfu": 1, "step_time_s": 1,
         "data_wait_s": 1, "peak_memory_gib": 1, "tokens_seen": 1, "tokens/books": 1, "predicted_tokens_per_s": 1,
         "predicted_mfu": 1, "predicted_step_time_s": 1, "predicted_peak_memory_gib": 1},
        {"kind": "eval", "step": 1, "val/books/loss": 1, "val/books/bpb": 1, "eval/austen_word_order/acc": 1},
        {"kind": "overlap", "step": 1, "comm/overlap_fraction": 1, "comm/overlap_fraction_min": 1,
         "comm/exposed_ms": 1, "comm/total_ms": 1},
        {"kind": "goodput", "step": 1, "fraction": 1, "startup_s": 1},
    ]  # fmt: skip
    names = {name for r in records for name in record_row(r)} | {"checkpoint/stall_s", "checkpoint/write_s"}
    assert unmatched(panel_series(), names) == []
    assert unmatched(["train/overlap_fraction"], names) == ["train/overlap_fraction"]  # negative control
