"""``lmforge --help``: every verb once, in plain text."""

from __future__ import annotations

from lmforge.cli import VERBS, main


def test_help_lists_each_verb_once_in_plain_text(capsys):
    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "usage: lmforge VERB ...  (one console entry point for every tool)"
    assert lines[-1] == "Run `lmforge VERB --help` for the options of each."
    listed = [line.split()[0] for line in lines[1:-1] if line.startswith("  ")]
    assert sorted(listed) == sorted(VERBS)  # each verb exactly once, no verb missing
    assert len(listed) == len(set(listed))
    assert "  data      prepare|train-tokenizer|export-tiktoken|debian ...   shards and tokenizers" in lines
    assert not any("``" in line for line in lines)  # no reStructuredText markup
    assert main([]) == 0 and capsys.readouterr().out.splitlines() == lines


def test_an_unknown_verb_names_the_nearest_one(capsys):
    assert main(["dat"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "lmforge: unknown verb 'dat' (did you mean 'data'?); verbs: " + ", ".join(sorted(VERBS))
    ]
