"""The tiers (tests/tiering.py): a test's tier from its folder and its recorded cost, the selection, and the fast
tier's guard against slow subprocesses, exercised here as a fast test itself; tests/run_tiers.py's verdicts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import run_tiers
from tiering import FAST_LIMIT_S, folder_tier, selected_tiers, slow_program, tier_of


def test_the_folder_gives_the_tier_and_a_recorded_cost_over_the_limit_moves_a_unit_test_to_full():
    assert folder_tier("tests/unit/test_x.py::test_a") == "fast"
    assert folder_tier("tests/distributed/test_x.py::test_a") == "full"
    assert folder_tier("tests/e2e/test_x.py") == "full" and folder_tier("tests/slurm/test_x.py") == "full"
    assert folder_tier("tests/drills/test_x.py::test_a") == "drills"
    assert folder_tier("tests/test_top.py::test_a") is None  # outside the tiered folders: full by default
    assert tier_of("tests/test_top.py::test_a", {}) == "full"
    slow = {"tests/unit/test_x.py::test_slow": FAST_LIMIT_S + 0.1, "tests/unit/test_x.py::test_ok": FAST_LIMIT_S}
    assert tier_of("tests/unit/test_x.py::test_slow", slow) == "full"
    assert tier_of("tests/unit/test_x.py::test_ok", slow) == "fast"  # at the limit: still fast
    assert tier_of("tests/drills/test_x.py::test_a", {"tests/drills/test_x.py::test_a": 1.0}) == "drills"


def test_selection_names_tiers_and_refuses_an_unknown_one():
    assert selected_tiers(None) == ("fast", "full")
    assert selected_tiers("all") == ("fast", "full", "drills")
    assert selected_tiers("fast, drills") == ("fast", "drills")
    with pytest.raises(pytest.UsageError, match="unknown tier 'fsat'; choose from fast, full, drills or all"):
        selected_tiers("fsat")


def test_slow_programs_are_python_torchrun_lmforge_and_slurm():
    assert slow_program([sys.executable, "-c", "pass"]) == sys.executable.rsplit("/", 1)[-1]
    assert slow_program(["/usr/bin/python3", "x.py"]) == "python3"
    assert slow_program("torchrun --nproc_per_node=2 -m lmforge.train") == "torchrun"
    assert slow_program(["sbatch", "slurm/train.sh"]) == "sbatch"
    assert slow_program(["bash", "-c", "true"]) is None and slow_program(["make", "-n"]) is None
    assert slow_program([]) is None


def test_a_fast_test_that_starts_python_fails_with_where_it_belongs():
    """This test is itself in the fast tier, so the guard is active here; a shell command still runs (control)."""
    with pytest.raises(AssertionError, match=r"a fast-tier test \(tests/unit\) started `python.*move the test to"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert subprocess.run(["bash", "-c", "exit 0"]).returncode == 0


def test_run_tiers_fails_a_tier_over_budget_only_when_enforced_and_a_tier_that_ran_no_test(monkeypatch, tmp_path):
    rows = {"fast": {"tier": "fast", "exit": 0, "wall_s": 1.0, "cpu_s": 601.0, "load_at_start": 0.0}}
    monkeypatch.setattr(run_tiers, "run_tier", lambda tier, args: dict(rows[tier]))
    out = str(tmp_path / "t.json")
    assert run_tiers.main(["fast", "--json", out]) == 0  # over budget, reported, not enforced
    assert run_tiers.main(["fast", "--enforce", "--json", out]) == 1
    rows["fast"]["cpu_s"] = 10.0
    assert run_tiers.main(["fast", "--enforce", "--json", out]) == 0  # control: within budget
    rows["fast"]["exit"] = run_tiers.NO_TESTS
    assert run_tiers.main(["fast", "--json", out]) == 1  # a tier that ran no test fails
