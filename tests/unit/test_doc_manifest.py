"""Every command the docs show is classed in tests/doc_commands.yaml, every entry is still shown, every block that
holds commands is labelled; the extraction and the checks are run on planted texts as their negative controls."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from doc_commands import (  # noqa: E402
    CLASSES,
    commands_in,
    doc_commands,
    hydra_overrides,
    load_manifest,
    manifest_problems,
    strip_comment,
)

FENCE = "```"


def page(*blocks: tuple) -> str:
    """A Markdown page of (label, lines) blocks, each after a line of prose."""
    out = ["# A page", ""]
    for label, lines in blocks:
        out += ["Some prose.", "", FENCE + label, *lines, FENCE, ""]
    return "\n".join(out)


def planted_repo(tmp_path: Path, readme: str, doc: str = "# Empty\n") -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "docs" / "page.md").write_text(doc)
    return tmp_path


def test_every_doc_command_is_in_the_manifest_and_every_entry_is_shown():
    commands, _ = doc_commands()
    entries = load_manifest()
    assert commands and entries
    assert manifest_problems(entries, commands) == []


def test_no_unlabelled_or_text_block_holds_a_command():
    _, suspects = doc_commands()
    assert [f"{s.where()}: {s.text}" for s in suspects] == []


def test_every_class_is_used_as_documented():
    counts = collections.Counter(e["class"] for e in load_manifest())
    assert set(counts) <= set(CLASSES)
    assert counts["cpu"] > 0 and counts["validate"] > 0
    for e in load_manifest():
        if e["class"] == "validate":
            assert e["world"] >= 1, e["command"]


def test_extraction_joins_continuations_strips_comments_keeps_and_chains():
    text = page(
        (
            "bash",
            [
                "# a comment line, skipped",
                "lmforge sweep plan --name demo && lmforge sweep run runs/demo \\",
                "  && lmforge sweep collect runs/demo       # an end-to-end sweep",
                "",
                'lmforge generate runs/x --prompt "a # in quotes" --stop "."   # greedy',
            ],
        ),
        ("console", ["$ lmforge train +exp=smoke   # refused", "lmforge: config key 'train.max_steps': ..."]),
        ("yaml", ["lmforge: not a command block"]),
    )
    commands, suspects = commands_in(text, "docs/x.md")
    assert [c.text for c in commands] == [
        "lmforge sweep plan --name demo && lmforge sweep run runs/demo && lmforge sweep collect runs/demo",
        'lmforge generate runs/x --prompt "a # in quotes" --stop "."',
        "lmforge train +exp=smoke",
    ]
    assert [c.line for c in commands] == [7, 10, 16]
    assert suspects == []


def test_strip_comment_only_outside_quotes_and_after_whitespace():
    assert strip_comment("a b  # c") == "a b"
    assert strip_comment("a '#b' # c") == "a '#b'"
    assert strip_comment('a "x # y"') == 'a "x # y"'
    assert strip_comment("a node#1") == "a node#1"


def test_a_command_in_an_unlabelled_or_text_block_is_reported_output_is_not():
    text = page(
        ("", ["lmforge plan +exp=gpt_1b", "launchers/torchrun_local.sh --nproc 2"]),
        ("text", ["$ make smoke", "lmforge: config key 'x': bad. Fix: y", "lmforge data prepare: a.jsonl:2: bad"]),
        ("", ["launchers/   the launchers (a layout listing)", "runs/smoke/", "step 1 | loss 9.0"]),
    )
    commands, suspects = commands_in(text, "docs/x.md")
    assert commands == []
    assert [s.text for s in suspects] == [
        "lmforge plan +exp=gpt_1b",
        "launchers/torchrun_local.sh --nproc 2",
        "$ make smoke",
    ]


def test_an_unlisted_command_and_a_stale_entry_are_reported(tmp_path):
    repo = planted_repo(tmp_path, page(("bash", ["make smoke", "lmforge train +exp=smoke run.name=new-one"])))
    commands, _ = doc_commands(repo)
    entries = [{"command": "make smoke", "class": "cpu"}, {"command": "lmforge plan +exp=gone", "class": "cpu"}]
    assert manifest_problems(entries, commands, repo) == [
        "README.md:7: command not in tests/doc_commands.yaml: lmforge train +exp=smoke run.name=new-one",
        "tests/doc_commands.yaml: stale entry, no doc shows it any more: lmforge plan +exp=gone",
    ]


def test_a_planted_unlabelled_command_block_is_reported(tmp_path):
    repo = planted_repo(tmp_path, "# R\n", page(("", ["sbatch slurm/train.sh +exp=gpt_1b"])))
    _, suspects = doc_commands(repo)
    assert [(s.where(), s.text) for s in suspects] == [("docs/page.md:6", "sbatch slurm/train.sh +exp=gpt_1b")]


def test_bad_entries_are_reported(tmp_path):
    repo = planted_repo(tmp_path, page(("bash", ["a", "b", "c", "d", "e", "f"])))
    commands, _ = doc_commands(repo)
    entries = [
        {"command": "a", "class": "sometimes"},
        {"command": "b", "class": "validate"},
        {"command": "c", "class": "gpu"},
        {"command": "d", "class": "ci", "test": ".ci/nope"},
        {"command": "e", "class": "bench", "test": "tests/nope.py"},
        {"command": "f", "class": "cpu", "exits": 2},
        {"command": "f", "class": "cpu"},
    ]
    assert manifest_problems(entries, commands, repo) == [
        "manifest entry 'a': class 'sometimes' is not one of " + ", ".join(CLASSES),
        "manifest entry 'b': a validate entry names its world size (world: N)",
        "manifest entry 'c': a gpu entry names the test that exercises it",
        "manifest entry 'd': its test .ci/nope does not exist",
        "manifest entry 'e': its test tests/nope.py does not exist",
        "manifest entry 'f': unknown key(s) exits",
        "manifest entry 'f': listed twice",
    ]


@pytest.mark.parametrize(
    "command, overrides",
    [
        ("lmforge plan --json +exp=gpt_1b cluster.nodes=4", ["+exp=gpt_1b", "cluster.nodes=4"]),
        ("lmforge launch --slurm --nodes 4 +exp=gpt_1b", ["cluster.nodes=4", "+exp=gpt_1b"]),
        (
            "sbatch --nodes=4 --gpus-per-node=8 --exclusive slurm/train.sh +exp=gpt_1b",
            ["cluster.nodes=4", "cluster.gpus_per_node=8", "+exp=gpt_1b"],
        ),
        ("sbatch slurm/train.sh +exp=gpt_1b optim.lr=2e-4", ["cluster.nodes=2", "+exp=gpt_1b", "optim.lr=2e-4"]),
        (
            "sbatch slurm/train.sh +exp=gpt_1b \"+comm.env.NCCL_ALGO='Ring,Tree'\"",
            ["cluster.nodes=2", "+exp=gpt_1b", "+comm.env.NCCL_ALGO='Ring,Tree'"],
        ),
        (
            "pdsh -w node[0-1] 'cd /x && launchers/torchrun_multinode.sh --nnodes 2 -- +exp=gpt_1b cluster.nodes=2'",
            ["+exp=gpt_1b", "cluster.nodes=2"],
        ),
        (
            "torchrun --nproc_per_node=8 -m lmforge.train +exp=gpt_1b parallelism=zero3_offload",
            ["+exp=gpt_1b", "parallelism=zero3_offload"],
        ),
        ("lmforge train data=debian_mix 'eval.tasks=[a,b]'", ["data=debian_mix", "eval.tasks=[a,b]"]),
    ],
)
def test_hydra_overrides_of_a_command(command, overrides):
    assert hydra_overrides(command) == overrides
