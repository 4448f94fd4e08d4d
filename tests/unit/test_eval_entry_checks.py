"""A bad eval task is refused by every entry point before anything starts (``evaluation.tasks.check_eval_config``,
the Trainer's own check): ``lmforge plan``, ``lmforge launch`` local and ``--slurm``, in one line, exit 2."""

from __future__ import annotations

import json
import shlex

import pytest

from lmforge.cli import main
from lmforge.evaluation.tasks import shipped_task_names

SHIPPED = ", ".join(shipped_task_names())


def missing_line(path) -> str:
    return (
        f"config key 'eval.tasks': {path}: no such task file. Fix: give the path of an lm-eval task YAML, or a "
        f"shipped task: {SHIPPED}"
    )


def valid_task(tmp_path):
    (tmp_path / "docs.jsonl").write_text(
        "".join(
            json.dumps({"q": q, "options": ["yes", "no"], "answer": a}) + "\n"
            for q, a in (("Is water wet?", 0), ("Is fire cold?", 1))
        )
    )
    path = tmp_path / "quiz.yaml"
    path.write_text(
        json.dumps(
            {
                "task": "quiz",
                "dataset_path": "json",
                "test_split": "test",
                "dataset_kwargs": {"data_files": {"test": "docs.jsonl"}},
                "output_type": "multiple_choice",
                "doc_to_text": "{{q}}",
                "doc_to_choice": "{{options}}",
                "doc_to_target": "{{answer}}",
            }
        )
    )  # JSON is YAML
    return path


@pytest.mark.timeout(120)
def test_plan_and_launch_refuse_a_missing_task_file_in_one_line_and_pass_a_valid_one(tmp_path, capsys):
    missing = tmp_path / "tasks" / "missing.yaml"
    runs = tmp_path / "runs"
    base = ["model=tiny", f"run.root={runs}"]
    assert main(["plan", *base, f"eval.tasks=['{missing}']"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"lmforge plan: refused: {missing_line(missing)}"], err
    # launch: local torchrun and Slurm (sbatch is never reached); nothing is started, submitted or written
    for mode in (["--nproc", "1"], ["--slurm", "--nodes", "1"]):
        assert main(["launch", *mode, *base, f"eval.tasks=['{missing}']"]) == 2, mode
        out, err = capsys.readouterr()
        assert err.splitlines() == [f"lmforge launch: {missing_line(missing)}"] and out == "", (mode, out, err)
    assert not runs.exists()
    # Negative control: a valid task file (and a shipped task) passes the same checks.
    task = valid_task(tmp_path)
    assert main(["plan", *base, f"eval.tasks=['{task}',austen_word_order]"]) == 0
    out, err = capsys.readouterr()
    assert "eval       downstream tasks: quiz 2 docs, austen_word_order " in out and "refused" not in err, (out, err)
    assert main(["launch", "--slurm", "--nodes", "1", "--dry-run", *base, f"eval.tasks=['{task}']"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip().endswith(shlex.quote(f"eval.tasks=['{task}']")) and err == "", err
