"""``sweep plan --wsd-branches``: the layout (one stable run per size, one cooldown branch per point), the FLOP
accounting against the from-scratch design, and the order ``sweep run`` trains them in (stable runs first)."""

from __future__ import annotations

import json
import math

import pytest

from lmforge.checkpoint.layout import COMPLETE, SIDECAR, step_dir
from lmforge.runtime.rundir import RunPaths
from lmforge.scaling.branches import branch_design, flops_summary
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.plan import Rules, load_sweep, plan, write_sweep
from lmforge.scaling.runner import DONE, PENDING, hydra_commands, local_commands, slurm_array_commands, status
from lmforge.scaling.shapes import ShapeFamily
from lmforge.scaling.worker import failure_path, run_point, stable_done

FAMILY = ShapeFamily(  # conf/sweep/tiny_cpu.yaml's family up to width 24: five one-layer sizes
    head_dim=4,
    aspect_min=8,
    aspect_max=128,
    max_width=24,
    min_layers=1,
    max_layers=1,
    vocab_size=512,
    seq_len=64,
    ffn_multiple_of=8,
    tie_embeddings=False,
)
BUDGETS = [4e9, 8e9]


def rules(**kw) -> Rules:
    return Rules(tpp_min=0.5, tpp_max=2000, sizes=5, min_steps=10, micro_batch_size=4, **kw)


def own(overrides, key):
    return next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(key + "="))


def test_one_stable_run_per_size_and_one_branch_per_point_with_its_flops(tmp_path):
    scratch = plan("wsd", BUDGETS, FAMILY, rules(), str(tmp_path))
    sweep = branch_design(scratch, rules())
    assert len(sweep.stable_runs) == 5 and len(sweep.points) == 10 and sweep.design == "wsd-branches"
    assert "optim.schedule=wsd" in sweep.common_overrides
    assert sweep.from_scratch_flops == sum(p.planned_flops for p in scratch.points)
    expected_total = 0.0
    for r in sweep.stable_runs:
        branches = [p for p in sweep.points if p.stable_run == r.id]
        assert [p.id for p in branches] == r.branches and {p.budget for p in branches} == set(BUDGETS)
        seq = 64
        for p in branches:
            # The decay: 20% of the branch's own steps, 1-sqrt; the branch resumes the stable checkpoint at its start.
            assert p.decay_steps == round(0.2 * p.max_steps) and p.branch_start + p.decay_steps == p.max_steps
            assert own(p.overrides, "optim.decay_steps") == str(p.decay_steps)
            assert own(p.overrides, "optim.decay_shape") == "1-sqrt"
            assert own(p.overrides, "train.max_steps") == str(p.max_steps)
            assert own(p.overrides, "train.resume") == str(
                step_dir(RunPaths(tmp_path / "wsd" / r.id).checkpoints, p.branch_start)
            )
            # One data plan, batch, LR and warmup per size: the stable run's.
            assert own(p.overrides, "train.planned_tokens") == str(r.planned_tokens)
            assert (p.global_batch_size, p.lr, p.warmup_steps) == (r.global_batch_size, r.lr, r.warmup_steps)
            # The point stands for a run planned for its budget: C = tokens x FLOPs/token, within the tolerance.
            assert p.tokens == p.max_steps * p.global_batch_size * seq
            assert p.planned_flops == p.tokens * p.flops_per_token and abs(p.planned_flops / p.budget - 1) < 0.05
            assert p.run_flops == p.decay_steps * p.global_batch_size * seq * p.flops_per_token
            expected_total += p.run_flops
        # The stable run: the WSD run planned for its largest budget, stopped at that budget's branch start, with
        # a kept checkpoint at every branch start.
        largest = max(branches, key=lambda p: p.budget)
        assert r.branch_starts == sorted(p.branch_start for p in branches) and r.max_steps == largest.branch_start
        assert own(r.overrides, "train.max_steps") == str(largest.max_steps)
        assert own(r.overrides, "train.stop_at_step") == str(r.max_steps)
        assert own(r.overrides, "optim.decay_steps") == str(largest.decay_steps)
        assert own(r.overrides, "checkpoint.at_steps") == "[" + ",".join(map(str, r.branch_starts)) + "]"
        assert own(r.overrides, "checkpoint.enabled") == "true" and own(r.overrides, "train.eval_every") == "0"
        assert r.planned_tokens == largest.tokens
        assert r.run_flops == r.max_steps * r.global_batch_size * seq * r.flops_per_token
        expected_total += r.run_flops
    assert sweep.total_flops() == pytest.approx(expected_total, rel=1e-12)
    assert sweep.total_flops() < 0.8 * sweep.from_scratch_flops
    ratio = sweep.total_flops() / sweep.from_scratch_flops
    assert flops_summary(sweep).endswith(f"({ratio:.1%} of from scratch, {1 - ratio:.1%} saved)")  # all shared
    # The sweep file keeps the layout and the provenance.
    write_sweep(sweep, tmp_path / "wsd")
    back = load_sweep(tmp_path / "wsd")
    assert back.to_json() == json.loads(json.dumps(sweep.to_json()))
    assert (tmp_path / "wsd" / "hydra" / "sweep_point" / f"{sweep.stable_runs[0].id}.yaml").is_file()


def test_the_summary_names_sizes_used_at_one_budget_only(tmp_path):
    sweep = branch_design(plan("wsd", [4e9, 8e9], FAMILY, rules(), str(tmp_path)), rules())
    sweep.stable_runs[0].branches = sweep.stable_runs[0].branches[:1]
    assert flops_summary(sweep).splitlines()[1] == (
        f"1 of 5 stable runs serve one budget only and save nothing ({sweep.stable_runs[0].id})"
    )


def test_a_branch_that_cannot_decay_after_the_warmup_is_refused(tmp_path):
    scratch = plan("wsd", BUDGETS, FAMILY, rules(), str(tmp_path))
    with pytest.raises(ScalingError) as e:
        branch_design(scratch, rules(decay_fraction=0.99))
    assert str(e.value) == (
        "point c4e9-l1-d8: its branch of 219 steps would start its 217-step decay at step 2, before the stable run's "
        "11 warmup steps end. Fix: lower rules.decay_fraction or rules.warmup_fraction, or raise rules.min_steps"
    )


def complete(path):
    path.mkdir(parents=True)
    (path / COMPLETE).write_text("")
    (path / SIDECAR).write_text("{}")


def test_stable_runs_train_before_their_branches(tmp_path, capsys):
    sweep = branch_design(plan("wsd", BUDGETS, FAMILY, rules(), str(tmp_path)), rules())
    out = tmp_path / "wsd"
    write_sweep(sweep, out)
    # Local: a stable run and its branches are one chain in one worker, the stable run first.
    for jobs in (1, 2):
        lanes = [c[c.index("--points") + 1].split(",") for c in local_commands(sweep, out, jobs=jobs)]
        assert sorted(sum(lanes, [])) == sorted(u.id for u in sweep.units())
        for ids in lanes:
            for r in sweep.stable_runs:
                if r.id in ids:
                    assert ids[ids.index(r.id) + 1 : ids.index(r.id) + 3] == r.branches
    # Hydra: the stable runs' multirun, then the branches'.
    first, second = hydra_commands(sweep, out)
    assert f"+sweep_point={','.join(r.id for r in sweep.stable_runs)}" in first
    assert f"+sweep_point={','.join(p.id for p in sweep.points)}" in second
    # Slurm: the stable runs' array (its job id read back), then per stable run its branches after that task.
    cmds = slurm_array_commands(sweep, out, tmp_path / "sweep_worker.sh")
    assert cmds[0][:3] == ["sbatch", "--parsable", "--array=0,1,2,3,4"]
    index = {u.id: i for i, u in enumerate(sweep.units())}
    for r, cmd in zip(sweep.stable_runs, cmds[1:]):
        assert cmd[1] == f"--dependency=afterok:$STABLE_JOB_{index[r.id]}"
        assert cmd[2] == f"--array={','.join(str(index[b]) for b in r.branches)}"
    # Once a stable run holds its branch checkpoints it is done: no longer submitted, its branches wait for nothing.
    done = sweep.stable_runs[0]
    assert not stable_done(done)
    for s in done.branch_starts:
        complete(step_dir(RunPaths(tmp_path / "wsd" / done.id).checkpoints, s))
    assert stable_done(done) and status(sweep)[done.id] == DONE
    cmds = slurm_array_commands(sweep, out, tmp_path / "sweep_worker.sh")
    assert (
        cmds[0][2] == "--array=1,2,3,4" and cmds[1][1] == f"--array={index[done.branches[0]]},{index[done.branches[1]]}"
    )


def test_a_branch_without_its_stable_checkpoint_is_not_started(tmp_path, capsys):
    sweep = branch_design(plan("wsd", BUDGETS, FAMILY, rules(), str(tmp_path)), rules())
    branch = sweep.points[0]
    assert run_point(sweep, branch) is False
    err = capsys.readouterr().err
    assert f"{branch.id}: not started: its stable run {branch.stable_run} has no complete checkpoint at step" in err
    assert not failure_path(RunPaths(tmp_path / "wsd" / branch.id)).exists()  # not a failure: retried next time
    assert status(sweep)[branch.id] == PENDING and math.isfinite(branch.run_flops)


def test_a_rate_per_size_reaches_every_point_and_stable_run(tmp_path):
    """rules.lr_by_size replaces lr(C): every point and stable run of a size trains at that size's rate (a branch
    at its stable run's), a size missing from the table is refused by name, and a table given on the command line
    (--rule lr_by_size=l1-d8:0.04,...) parses to the same."""
    table = {"l1-d8": 0.04, "l1-d12": 0.03, "l1-d16": 0.02, "l1-d20": 0.015, "l1-d24": 0.01}
    sweep = branch_design(plan("w", BUDGETS, FAMILY, rules(lr_by_size=table), str(tmp_path)), rules())
    assert {f"l{p.n_layers}-d{p.d_model}" for p in sweep.points} == set(table)
    for unit in sweep.units():
        rate = table[f"l{unit.n_layers}-d{unit.d_model}"]
        assert unit.lr == rate and own(unit.overrides, "optim.lr") == repr(rate)
    # Without the table a point's rate is its budget's lr(C), whatever its size: the control.
    assert {(p.budget, p.lr) for p in plan("w", BUDGETS, FAMILY, rules(), str(tmp_path)).points} == {
        (c, rules().lr(c, "l1-d8")) for c in BUDGETS
    }
    with pytest.raises(ScalingError, match=r"rules.lr_by_size: has no rate for size l1-d24 .*Fix: add l1-d24: <lr>"):
        plan("w", BUDGETS, FAMILY, rules(lr_by_size={k: v for k, v in table.items() if k != "l1-d24"}), str(tmp_path))
    assert rules(lr_by_size="l1-d8:0.04,l1-d12:0.03,l1-d16:0.02,l1-d20:0.015,l1-d24:0.01").check().lr_by_size == table
    with pytest.raises(ScalingError, match="rules.lr_by_size: must map shape names to rates"):
        rules(lr_by_size="l1-d8=0.04").check()
