"""Every file lmforge writes in a run directory is 0o640 and every directory 0o750, whatever the umask.

In process, through the writers themselves (run dir, metrics sink, provenance, verdicts, crash record, retry
state, heartbeat); a whole training run's directory is walked in tests/e2e/test_first_start.py and the HF export's
in tests/unit/test_interop_hf.py."""

from __future__ import annotations

import pytest
from file_modes_check import umask, wrong_modes

from lmforge.runtime.file_modes import make_dir, open_append, set_tree, write_text


@pytest.mark.parametrize("mask", [0o002, 0o077])
def test_the_helpers_set_the_modes_whatever_the_umask(tmp_path, mask):
    root = tmp_path / "run"
    with umask(mask):
        make_dir(root)
        make_dir(root / "logs")
        write_text(root / "config.yaml", "a: 1\n")
        write_text(root / "config.yaml", "a: 2\n")  # rewritten: still the policy's mode
        with open_append(root / "metrics.jsonl") as fh:
            fh.write("{}\n")
    assert (root / "config.yaml").read_text() == "a: 2\n"
    assert wrong_modes(root) == []


def test_negative_control_a_plain_write_takes_the_umask_and_set_tree_corrects_what_others_wrote(tmp_path):
    root = make_dir(tmp_path / "run")
    with umask(0o002):
        (root / ".hydra").mkdir()
        (root / ".hydra" / "config.yaml").write_text("x: 1\n")  # as Hydra writes it
    assert wrong_modes(root) == ["run/.hydra 775", "run/.hydra/config.yaml 664"]
    set_tree(root / ".hydra")
    assert wrong_modes(root) == []


def test_the_run_directory_writers_follow_the_policy(tmp_path):
    from lmforge.fault import retry, verdict
    from lmforge.fault.watchdog import Watchdog
    from lmforge.metrics.sinks import JsonlSink
    from lmforge.runtime import provenance
    from lmforge.runtime.rundir import RunPaths

    with umask(0o002):
        paths = RunPaths(tmp_path / "run").make()
        sink = JsonlSink(paths.metrics)
        sink.log({"kind": "train", "step": 1})
        sink.close()
        provenance.write(paths.provenance, {"git": "abc"})
        verdict.write(paths.root, verdict.Verdict(verdict.VerdictKind.CRASH, 0, 3, "boom", 1))
        verdict.archive(paths.root)  # verdicts/history.jsonl
        verdict.record_crash(paths.root, 0, 3, "RuntimeError", "Traceback ...", 0.0)
        retry.record(paths.root, 1, signalled=False, max_failures=2)  # requeues.json
        dog = Watchdog(0, 60.0, paths.dumps, heartbeat_dir=paths.heartbeats)  # not started: no thread
        dog.write_heartbeat()
        dog.dump("a test")  # dumps/watchdog-rank0-...txt
    names = {p.relative_to(paths.root).as_posix() for p in paths.root.rglob("*")}
    assert {"metrics.jsonl", "provenance.json", "verdicts/history.jsonl", "requeues.json"} <= names, names
    assert any(n.startswith("crashes/step-00000003-RuntimeError-rank0") for n in names), names
    assert "heartbeats/rank0.json" in names and any(n.startswith("dumps/watchdog-rank0") for n in names), names
    assert wrong_modes(paths.root) == []
