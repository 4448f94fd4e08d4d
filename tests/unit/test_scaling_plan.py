"""Sweep planning: IsoFLOP grid arithmetic, batch/LR rules, the sweep file and its Hydra forms."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from lmforge.config.compose import compose
from lmforge.config.optim import OptimConfig
from lmforge.config.validate import validate
from lmforge.data.embedded import iter_documents
from lmforge.data.tokenizer import train_bpe
from lmforge.model.flops import flops_per_token
from lmforge.optim.schedule import lr_multiplier
from lmforge.scaling.errors import ScalingError
from lmforge.scaling.plan import Rules, load_sweep, plan, write_sweep
from lmforge.scaling.runner import hydra_command, local_commands, slurm_array_command, status
from lmforge.scaling.shapes import ShapeFamily

GPU_FAMILY = ShapeFamily(
    head_dim=64,
    aspect_min=48,
    aspect_max=128,
    max_width=4096,
    min_layers=4,
    max_layers=40,
    vocab_size=50304,
    seq_len=2048,
)
BUDGETS = [1e18, 3e18, 1e19, 3e19, 1e20]


def test_cluster_grid_hits_every_budget_with_at_least_five_sizes(tmp_path):
    rules = Rules(sizes=7, dp=8, min_steps=200)
    sweep = plan("chin", BUDGETS, GPU_FAMILY, rules, str(tmp_path))
    for c in BUDGETS:
        pts = [p for p in sweep.points if p.budget == c]
        assert len(pts) == 7 and len({p.n_flops for p in pts}) == 7
        ns = sorted(p.n_flops for p in pts)
        assert ns[-1] / ns[0] > 5  # the profile spans a useful range of sizes
        for p in pts:
            # The one FLOPs function sizes every run: planned FLOPs = tokens * flops_per_token(model), within 5%.
            assert p.flops_per_token == p.n_flops * 6
            assert p.planned_flops == p.tokens * p.flops_per_token
            assert abs(p.planned_flops / c - 1) < 0.05
            assert rules.tpp_min <= p.tokens / p.n_flops * (1 + abs(p.budget_error)) * 1.01
            # Batch rule: tokens per step = 0.292 C^0.3271 rounded to the micro*dp unit (or lowered for min_steps).
            unit = rules.micro_batch_size * rules.dp
            assert p.global_batch_size % unit == 0
            target_seqs = 0.292 * c**0.3271 / 2048
            assert p.global_batch_size <= max(unit, round(target_seqs / unit) * unit)
            assert p.max_steps >= rules.min_steps
            assert p.lr == pytest.approx(0.3118 * c**-0.125)
            # The schedule ends exactly at the run's own token count.
            assert p.tokens == p.max_steps * p.global_batch_size * 2048
            assert f"train.planned_tokens={p.tokens}" in p.overrides and f"train.max_steps={p.max_steps}" in p.overrides
            assert p.warmup_steps == max(1, round(0.05 * p.max_steps))
    # Larger budgets get larger models at the optimum end.
    assert max(p.n_flops for p in sweep.points if p.budget == 1e20) > max(
        p.n_flops for p in sweep.points if p.budget == 1e18
    )


def test_lr_schedule_reaches_its_floor_exactly_at_max_steps():
    sweep = plan(
        "s",
        [1e10, 3e10],
        ShapeFamily(
            head_dim=8,
            aspect_min=8,
            aspect_max=64,
            max_width=128,
            min_layers=1,
            max_layers=4,
            vocab_size=512,
            seq_len=64,
            ffn_multiple_of=8,
        ),
        Rules(tpp_min=0.5, tpp_max=100),
        "/tmp/unused",
    )
    for p in sweep.points:
        cfg = OptimConfig(lr=p.lr, warmup_steps=p.warmup_steps, min_lr_ratio=0.1, schedule="cosine")
        assert lr_multiplier(p.max_steps, cfg, p.max_steps) == pytest.approx(0.1)
        assert lr_multiplier(p.max_steps - 1, cfg, p.max_steps) > 0.1
        assert lr_multiplier(p.warmup_steps - 1, cfg, p.max_steps) == pytest.approx(1.0)


def test_every_point_composes_and_shares_one_validation_set(tmp_path):
    fam = ShapeFamily(
        head_dim=8,
        aspect_min=8,
        aspect_max=64,
        max_width=128,
        min_layers=1,
        max_layers=4,
        vocab_size=512,
        seq_len=64,
        ffn_multiple_of=8,
    )
    # A tokenizer of the family's vocabulary (lmforge sweep plan adds one for embedded_tokenizer_vocab presets):
    # validate() refuses a model.vocab_size below the tokenizer's.
    tok = train_bpe([d for _, d in zip(range(6), iter_documents("books"))], 512, tmp_path / "tok512.json")
    sweep = plan(
        "val",
        [1e10, 3e10],
        fam,
        Rules(tpp_min=0.5, tpp_max=100, eval_batches=4),
        str(tmp_path),
        ["~data.sources.code", "~data.sources.reference", f"data.tokenizer={tok}"],
    )
    out = tmp_path / "val"
    write_sweep(sweep, out)
    loaded = load_sweep(out)
    assert [p.id for p in loaded.points] == [p.id for p in sweep.points]
    seen = set()
    for p in loaded.points[:: max(1, len(loaded.points) // 3)]:
        typed = validate(compose(p.overrides))
        m = typed.model
        assert flops_per_token(m) == p.flops_per_token
        # The validation set is eval_batches * micro_batch * dp samples of each source, same seed and seq_len.
        seen.add(
            (
                typed.train.micro_batch_size,
                typed.train.eval_batches,
                typed.train.seed,
                m.seq_len,
                tuple(typed.data.sources),
            )
        )
        assert typed.run.sweep_name == "val" and typed.logging.wandb.group == "val"
        assert typed.run.sweep_point == f"val/{p.id}" and p.run_dir == str(tmp_path / "val" / p.id)
        assert (typed.run.sweep_params, typed.run.sweep_tokens, typed.run.sweep_flops) == (
            p.n_flops,
            p.tokens,
            p.planned_flops,
        )
        assert f"budget={p.id.split('-')[0][1:]}" in typed.logging.wandb.tags
        # The Hydra multirun form (config group written by the planner) composes to the identical config.
        via_group = compose(
            [f"hydra.searchpath=[file://{out / 'hydra'}]", f"+sweep_point={p.id}", *loaded.common_overrides]
        )
        assert OmegaConf.to_container(via_group) == OmegaConf.to_container(compose(p.overrides))
    assert len(seen) == 1
    assert (out / "overrides.txt").read_text().count("\n") == len(sweep.points)


def test_run_commands_cover_only_unfinished_points(tmp_path, capsys):
    fam = ShapeFamily(
        head_dim=8,
        aspect_min=8,
        aspect_max=64,
        max_width=128,
        min_layers=1,
        max_layers=4,
        vocab_size=512,
        seq_len=64,
        ffn_multiple_of=8,
    )
    sweep = plan("cmd", [1e10], fam, Rules(tpp_min=0.5, tpp_max=100), str(tmp_path))
    out = tmp_path / "cmd"
    write_sweep(sweep, out)
    done = sweep.points[1]
    (tmp_path / "cmd" / done.id).mkdir(parents=True)
    (tmp_path / "cmd" / done.id / "DONE").write_text("{}")
    failed = sweep.points[2]
    (tmp_path / "cmd" / failed.id / "logs").mkdir(parents=True)
    (tmp_path / "cmd" / failed.id / "logs" / "sweep-failure.txt").write_text("Traceback\nRuntimeError: boom\n")
    st = status(sweep)
    assert st[done.id] == "done" and st[failed.id] == "failed" and list(st.values()).count("pending") == 3
    todo = [p.id for p in sweep.points if p.id != done.id]
    local = local_commands(sweep, out, jobs=2)
    assert len(local) == 2 and sorted(",".join(c[-1] for c in local).split(",")) == sorted(todo)
    hyd = hydra_command(sweep, out, "submitit_slurm", ["partition=gpu", "timeout_min=60"])
    assert "--multirun" in hyd and f"+sweep_point={','.join(todo)}" in hyd and "hydra/launcher=submitit_slurm" in hyd
    assert "hydra.launcher.partition=gpu" in hyd and "hydra.sweep.subdir=${run.sweep_point}" in hyd
    arr = slurm_array_command(sweep, out, tmp_path / "sweep_worker.sh")
    assert arr[1] == "--array=0,2,3,4" and arr[-1] == str(out / "sweep.json")
    # The same through the registered CLI verbs.
    from lmforge.cli import main as lmforge

    capsys.readouterr()
    assert lmforge(["sweep", "run", str(out), "--launcher", "slurm-array", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "sbatch --array=0,2,3,4 --job-name=sweep-cmd " in printed
    assert f"slurm/sweep_worker.sh {out / 'sweep.json'}" in printed  # the worker array script, not sweep_array.sh
    assert lmforge(["sweep", "status", str(out)]) == 1
    report = capsys.readouterr().out
    assert "1 done, 1 failed, 0 started, 3 pending" in report and f"FAILED {failed.id}: RuntimeError: boom" in report


def test_plan_errors_name_the_budget_and_the_fix(tmp_path):
    fam = ShapeFamily(
        head_dim=8,
        aspect_min=8,
        aspect_max=64,
        max_width=128,
        min_layers=1,
        max_layers=4,
        vocab_size=512,
        seq_len=64,
        ffn_multiple_of=8,
    )
    with pytest.raises(ScalingError) as e:
        plan("x", [1e10, 1e16], fam, Rules(tpp_min=0.5, tpp_max=100), str(tmp_path))
    msg = str(e.value)
    assert msg.startswith("budget C=1e16: only") and "5 sizes are required" in msg and "Fix: widen --tpp" in msg
    with pytest.raises(ScalingError, match="needs at least 5"):
        plan("x", [1e10], fam, Rules(sizes=3), str(tmp_path))
    with pytest.raises(ScalingError, match="tpp_min < tpp_max"):
        plan("x", [1e10], fam, Rules(tpp_min=50, tpp_max=10), str(tmp_path))
    with pytest.raises(ScalingError, match="odd"):
        plan("x", [1e10], ShapeFamily(head_dim=7), Rules(), str(tmp_path))


def test_cpu_hour_preset_puts_the_expected_optimum_inside_every_budget_and_fits_the_hour(tmp_path):
    from lmforge.scaling.cli import load_preset
    from lmforge.scaling.plan import optimum_check, time_estimate

    preset = load_preset("cpu_hour")
    family, rules = ShapeFamily(**preset["family"]), Rules(**preset["rules"])
    sweep = plan("cpu_hour", preset["budgets"], family, rules, str(tmp_path))
    assert len(sweep.points) == 4 * 8 and all(abs(p.budget_error) < 0.01 for p in sweep.points)
    assert max(p.tokens for p in sweep.points) < 8e6  # at most ~1.6 passes over the embedded corpora (announced)
    lines = optimum_check(sweep)
    assert len(lines) == 4 and all(line.endswith(": interior") for line in lines), lines
    minutes = float(time_estimate(sweep).split()[2])
    assert 4 <= minutes <= 60, time_estimate(sweep)  # measured: 7.4 min on 2 idle cores
    # Negative control: expecting the optimum at 1 token per parameter puts it past the largest sizes.
    rules.expected_tpp = 1.0
    off = optimum_check(plan("cpu_hour", preset["budgets"], family, rules, str(tmp_path)))
    assert not any(line.endswith(": interior") for line in off), off


def test_tiny_cpu_preset_brackets_the_expected_optimum_at_both_budgets(tmp_path):
    from lmforge.scaling.cli import load_preset
    from lmforge.scaling.plan import optimum_check

    preset = load_preset("tiny_cpu")
    family, rules = ShapeFamily(**preset["family"]), Rules(**preset["rules"])
    sweep = plan("tiny_cpu", preset["budgets"], family, rules, str(tmp_path))
    assert [p.budget for p in sweep.points] == [1e10] * 7 + [3e10] * 7
    assert all(p.n_layers == 1 and abs(p.budget_error) < 0.01 for p in sweep.points)
    assert sum(p.planned_flops for p in sweep.points) < 3e11  # the README demo's CPU time scales with this
    lines = optimum_check(sweep)
    assert len(lines) == 2 and all(line.endswith(": interior") for line in lines), lines
    # Negative control: at 3e9 FLOPs the family's smallest width is already at the optimum; too few sizes fit.
    with pytest.raises(ScalingError, match=r"budget C=3e9: only \d shape\(s\)"):
        plan("tiny_cpu", [3e9], family, rules, str(tmp_path))
