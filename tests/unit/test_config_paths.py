"""Paths from the config stay inside the run root unless the user typed an absolute path (config/paths.py).

Each key is checked through ``validate`` on a real Hydra composition (composed once, each value merged on top as a
command-line override would be); ``lmforge train`` is run through the real CLI for the run-name case (exact line,
exit 2, nothing written outside the root, not even by Hydra)."""

from __future__ import annotations

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
