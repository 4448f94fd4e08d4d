"""The console's start block and end summary (metrics/run_summary.py), word for word, without training; the smoke
run's own block and summary are checked against its files in tests/e2e/test_smoke.py."""

from __future__ import annotations

from lmforge.metrics.run_summary import (
    RunSummary,
    StartInfo,
    continue_hint,
    count,
    next_steps_line,
    run_info,
    start_block,
    wandb_line,
)


def info(**changes) -> StartInfo:
    base = dict(
        run_dir="runs/r",
        launch=0,
        resumed_from=None,
        model="gpt_1b",
        parameters=1_176_000_000,
        precision="bf16-mixed",
        device="cuda:0",
        world_size=16,
        backend="nccl",
        mesh={"pp": 1, "dp_replicate": 2, "dp_shard": 4, "cp": 1, "tp": 2},
        max_steps=1000,
        last_step=1000,
        tokens_per_step=1_048_576,
        wandb=wandb_line("online", url="https://wandb.example/lmforge/runs/ab12"),
    )
    return StartInfo(**{**base, **changes})


def test_counts_read_like_model_cards():
    assert [count(n) for n in (950, 4_300_000, 1_176_000_000, 405e9, 1.2e12)] == ["950", "4.3M", "1.2B", "405B", "1.2T"]


def test_the_start_block_names_the_run_model_layout_plan_and_wandb():
    assert start_block(info()) == [
        "lmforge: run runs/r (launch 0, fresh start)",
        "lmforge: model gpt_1b: 1.2B parameters, precision bf16-mixed on cuda:0",
        "lmforge: layout 16 processes (nccl), mesh: dp_replicate 2 x dp_shard 4 x tp 2",
        "lmforge: plan 1,000 steps x 1,048,576 tokens = 1,048,576,000 tokens (1,000 to go)",
        "lmforge: W&B online: https://wandb.example/lmforge/runs/ab12",
    ]


def test_a_resumed_stopping_single_process_launch_says_so():
    lines = start_block(
        info(
            launch=2,
            resumed_from=400,
            world_size=1,
            backend="gloo",
            mesh={"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1},
            last_step=600,
            wandb=wandb_line("offline", offline_dir="runs/r/wandb/offline-run-1-ab12"),
        )
    )
    assert lines[0] == "lmforge: run runs/r (launch 2, continues at step 400)"
    assert lines[2] == "lmforge: layout 1 process (gloo), mesh: single"
    assert lines[3].endswith("tokens (200 to go, stopping at step 600)")
    assert lines[4] == (
        "lmforge: W&B offline: runs/r/wandb/offline-run-1-ab12 (sync: wandb sync runs/r/wandb/offline-run-1-ab12)"
    )
    assert wandb_line(None) == "off (logging.wandb.mode, or WANDB_MODE=disabled)"


def test_the_summary_keeps_the_final_and_best_validation_loss_and_median_throughput():
    s = RunSummary()
    for step, loss, tps, mfu in ((1, 9.0, 100.0, 0.01), (10, 7.0, 900.0, 0.30), (20, 6.0, 1000.0, 0.32)):
        s.log({"kind": "train", "step": step, "loss": loss, "tokens_per_s": tps, "mfu": mfu})
    s.log({"kind": "eval", "step": 10, "val/books/loss": 6.5, "val/books/ppl": 665.1, "val/code/loss": 5.0})
    s.log({"kind": "eval", "step": 20, "val/books/loss": 6.1, "val/code/loss": 5.2})  # code got worse
    s.log({"kind": "fp8_check", "step": 20, "fp8/loss_gap": 0.01})  # neither train nor eval: not counted
    s.event({"kind": "event", "event": "checkpoint_save", "step": 20})
    assert s.lines(start_step=0, end_step=20, max_steps=20, wall_s=61.25) == [
        "lmforge: summary: steps 0 -> 20 of 20 in 61.2 s; loss 6.0000; median 900 tokens/s, MFU 30.0% (3 intervals)",
        "lmforge: validation loss, final (best at step): books 6.1000 (6.1000 at 20), code 5.2000 (5.0000 at 10)",
    ]


def test_a_launch_that_logged_nothing_has_a_one_line_summary():
    assert RunSummary().lines(start_step=4, end_step=4, max_steps=4, wall_s=3.0) == [
        "lmforge: summary: steps 4 -> 4 of 4 in 3.0 s"
    ]


def test_the_last_line_says_how_to_generate_and_train_further():
    assert next_steps_line("runs/r", "runs/r/checkpoints/step-00000300", 300) == (
        "lmforge: last checkpoint runs/r/checkpoints/step-00000300. Generate: lmforge generate runs/r --prompt TEXT; "
        "train further: the same command with train.max_steps above 300 (train.resume=auto resumes from step 300)"
    )
    assert next_steps_line("runs/r", None, 300).startswith("lmforge: no checkpoint saved")


def test_a_launch_that_named_its_checkpoint_is_told_to_resume_auto_instead():
    # a cooldown branch starts from its stable run's checkpoint: repeating that path would start there again
    line = next_steps_line("runs/b", "runs/b/checkpoints/step-00000400", 400, resume="runs/s/checkpoints/step-300")
    assert line.endswith(
        "(with train.resume=auto instead of train.resume=runs/s/checkpoints/step-300: "
        "train.resume=auto resumes from step 400)"
    )
    assert continue_hint("auto", 7) == continue_hint("none", 7) == "train.resume=auto resumes from step 7"


def test_run_info_holds_the_block_as_values_with_versions_and_nodes():
    values = run_info(info(), {"torch": "2.13.0", "cuda": "12.8", "nccl": "2.27.3"}, ["n[001-002]"])
    assert values["mesh"] == "dp_replicate 2 x dp_shard 4 x tp 2" and values["mesh/tp"] == 2
    assert values["tokens_planned"] == 1000 * 1_048_576 and values["parameters"] == 1_176_000_000
    assert (values["torch"], values["nccl"], values["nodes"]) == ("2.13.0", "2.27.3", ["n[001-002]"])
