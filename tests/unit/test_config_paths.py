"""Paths from the config stay inside the run root unless the user typed an absolute path (config/paths.py).

Each key is checked through ``validate`` on a real Hydra composition (composed once, each value merged on top as a
command-line override would be); ``lmforge train`` is run through the real CLI for the run-name case (exact line,
exit 2, nothing written outside the root, not even by Hydra)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate
from lmforge.runtime.rundir import RunPathError, resolve_run_dir
from lmforge.scaling.errors import ScalingError

REFUSED = [
    (
        "run.name=../../x",
        "config key 'run.name': '../../x' climbs out with a '..' component, so the run would be "
        "written outside run.root (ROOT). Fix: give a name inside the root (e.g. run.name=x), or choose the directory "
        "with run.root=DIR",
    ),
    (
        "run.name=/tmp/elsewhere",
        "config key 'run.name': '/tmp/elsewhere' is an absolute path, so the run would be "
        "written outside run.root (ROOT). Fix: give a name inside the root (e.g. run.name=elsewhere), or choose the "
        "directory with run.root=DIR",
    ),
    (
        "run.sweep_point=s/../../p",
        "config key 'run.sweep_point': 's/../../p' climbs out with a '..' component, so "
        "the run would be written outside run.root (ROOT). Fix: give a name inside the root (e.g. run.sweep_point=p), "
        "or choose the directory with run.root=DIR",
    ),
    (
        "run.sweep_name=..",
        "config key 'run.sweep_name': '..' climbs out with a '..' component, so the run would be "
        "written outside run.root (ROOT). Fix: give a name inside the root (e.g. run.sweep_name=myrun), or choose the "
        "directory with run.root=DIR",
    ),
    (
        "data.cache_dir=../cache",
        "config key 'data.cache_dir': the relative path '../cache' climbs out with a '..' "
        "component. Fix: write the absolute path of the directory you mean",
    ),
    (
        "train.resume=runs/../../other/checkpoints",
        "config key 'train.resume': the relative path "
        "'runs/../../other/checkpoints' climbs out with a '..' component. Fix: write the absolute path of the "
        "directory you mean",
    ),
    (
        "train.init_from=../hf-import",
        "config key 'train.init_from': the relative path '../hf-import' climbs out "
        "with a '..' component. Fix: write the absolute path of the directory you mean",
    ),
]
ALLOWED = [
    "run.name=group/run-1",
    "run.sweep_point=sweep/c1e11-l2-d64",
    "run.root=../anywhere/runs",
    "data.cache_dir=/shared/cache",
    "data.cache_dir=cache/here",
    "train.resume=/elsewhere/run/checkpoints",
    "train.resume=auto",
    "train.resume=none",
    "train.init_from=~/imports/hf",
    "train.init_from=imports/hf",
]


@pytest.fixture(scope="module")
def base():
    return compose(["run.root=/placeholder"])


def _validate(base, *dotlist):
    return validate(OmegaConf.merge(base, OmegaConf.from_dotlist(list(dotlist))), world_size=1)


@pytest.mark.parametrize("override,line", REFUSED, ids=[r[0].split("=")[0] for r in REFUSED])
def test_paths_leaving_the_root_are_refused(base, tmp_path, override, line):
    with pytest.raises(ConfigError) as err:
        _validate(base, f"run.root={tmp_path}", override)
    assert str(err.value) == line.replace("ROOT", str(tmp_path))


def test_paths_inside_the_root_or_typed_absolute_pass(base):
    for override in ALLOWED:  # negative control: the same keys with values the rule allows
        _validate(base, override)
    assert compose(["run.name=group/run-1"]).run.name == "group/run-1"  # and Hydra's own composition agrees


def test_run_dir_resolution_refuses_escaping_names_itself(tmp_path):
    assert resolve_run_dir(tmp_path, "a/b") == tmp_path.absolute() / "a" / "b"
    with pytest.raises(RunPathError, match=r"run.name=\.\./x climbs out"):
        resolve_run_dir(tmp_path, "../x")
    with pytest.raises(RunPathError, match="run.sweep_point=/abs is an absolute path"):
        resolve_run_dir(tmp_path, None, "/abs")


def test_sweep_names_that_would_climb_out_are_refused():
    from lmforge.scaling.plan import Rules, plan
    from lmforge.scaling.shapes import ShapeFamily

    with pytest.raises(ScalingError, match="'..' is not a usable sweep name"):
        plan("..", [1e11], ShapeFamily(), Rules(), "runs")


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "train", *overrides],
        cwd=tmp_path,
        env=os.environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(400)
def test_cli_refuses_a_run_name_outside_the_root_before_anything_is_written(tmp_path):
    root = tmp_path / "a" / "runs"
    out = _train(tmp_path, f"run.root={root}", "run.name=../../escaped", "model=tiny")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"lmforge: config key 'run.name': '../../escaped' climbs out with a '..' component, so the run would be "
        f"written outside run.root ({root}). Fix: give a name inside the root (e.g. run.name=escaped), or choose "
        f"the directory with run.root=DIR"
    )
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the escaped directory nor the root
    # Negative control: a name inside the root passes the path rule and fails on the next check instead.
    out = _train(tmp_path, f"run.root={root}", "run.name=inside", "model=tiny", "train.max_steps=0")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "lmforge: config key 'train.max_steps': must be >= 1, got 0. Fix: set a positive value"
    )
    assert (root / "inside").is_dir() and not (tmp_path / "escaped").exists()
