"""``python benchmarks/run.py``: --help lists the suites (it is not a suite name), an unknown suite is one line
and exit 2, and the script runs from any directory (it puts the checkout on sys.path itself)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.run import DEFAULT, SUITE_HELP, SUITES, parse_args  # noqa: E402


def test_help_lists_every_suite_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert set(SUITE_HELP) == set(SUITES)
    for name, what in SUITE_HELP.items():
        assert f"  {name:<18} {what}" in out


def test_unknown_suite_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["step", "nope"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"benchmarks: unknown suite 'nope'. Fix: choose from {', '.join(SUITES)}"
    ]
    assert parse_args([]) == DEFAULT and parse_args(["checkpoint"]) == ["checkpoint"]  # control: known names pass


def test_runs_as_a_file_from_another_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != REPO])
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "run.py"), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(REPO / "benchmarks" / "run.py"), run_name="__main__")
    assert exit_.value.code == 0 and "suites:" in capsys.readouterr().out
    assert str(REPO) in sys.path  # what lets the suites' `import benchmarks.*` work from another directory
