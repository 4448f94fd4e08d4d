"""The console's eval line: losses and bits per byte, then each task's accuracies (metrics/sinks.py)."""

from __future__ import annotations

import io

from lmforge.metrics.sinks import PlainConsoleSink, RichConsoleSink

RECORD = {  # the keys the trainer logs with kind "eval": val/<source>/*, then the evaluation runner's eval/<task>/*
    "kind": "eval",
    "step": 300,
    "tokens_seen": 1228800,
    "val/books/loss": 3.21456,
    "val/books/bpb": 1.19872,
    "eval/austen_word_order/acc": 0.995,
    "eval/austen_word_order/acc_norm": 0.99,
    "eval/austen_word_order/ll_gold": -41.5,
    "eval/austen_word_order/ll_other": -55.25,
    "eval/stdlib_next_line/acc": 0.23,
    "eval/stdlib_next_line/acc_norm": 0.24,
    "eval/stdlib_next_line/ll_gold": -20.0,
    "eval/stdlib_next_line/ll_other": -21.0,
}


def test_plain_console_eval_line_shows_losses_then_task_accuracies():
    stream = io.StringIO()
    PlainConsoleSink(stream).log(RECORD)
    assert stream.getvalue().splitlines() == [
        "eval step 300: val/books/loss=3.2146 val/books/bpb=1.1987 austen_word_order_acc=0.995 "
        "austen_word_order_acc_norm=0.990 stdlib_next_line_acc=0.230 stdlib_next_line_acc_norm=0.240"
    ]
    stream = io.StringIO()  # a run without downstream tasks: the losses alone
    PlainConsoleSink(stream).log({k: v for k, v in RECORD.items() if not k.startswith("eval/")})
    assert stream.getvalue() == "eval step 300: val/books/loss=3.2146 val/books/bpb=1.1987\n"


def test_rich_console_eval_line_is_one_unwrapped_line(capsys):
    sink = RichConsoleSink(total_steps=300)
    sink.log(RECORD)
    sink.close()
    lines = capsys.readouterr().out.splitlines()
    assert (
        "eval step 300: val/books/loss=3.215 val/books/bpb=1.199 austen_word_order_acc=0.995 "
        "austen_word_order_acc_norm=0.990 stdlib_next_line_acc=0.230 stdlib_next_line_acc_norm=0.240"
    ) in lines


def test_fp8_check_records_get_their_own_line_not_a_progress_update_with_no_loss(capsys):
    check = {"kind": "fp8_check", "step": 40, "fp8/loss": 3.5012, "fp8/bf16_loss": 3.4987, "fp8/loss_gap": 0.0025}
    stream = io.StringIO()
    PlainConsoleSink(stream).log(check)
    assert stream.getvalue() == "fp8 check step 40: loss 3.5012 against bf16 3.4987 (gap +0.0025)\n"
    sink = RichConsoleSink(total_steps=100)
    sink.log(check)
    completed = sink.progress.tasks[0].completed
    sink.close()
    assert "fp8 check step 40: loss 3.501 against bf16 3.499 (gap +0.003)" in capsys.readouterr().out.splitlines()
    assert completed == 0  # the bar did not move to the check's step with a NaN loss
