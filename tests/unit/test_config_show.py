"""``lmforge config show``: value, default, choices, meaning and the file that set each key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmforge.cli import main as cli_main
from lmforge.config.errors import ConfigError
from lmforge.config.show import render

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def block(lines, key):
    """The lines of one key's entry."""
    start = lines.index(next(line for line in lines if line.startswith(f"{key} = ")))
    end = lines.index("", start) if "" in lines[start:] else len(lines)
    return lines[start:end]


def test_one_key():
    assert render(["optim.lr"]) == [
        "optim.lr = 0.0003",
        "  default  0.0003",
        "  range    >= 0",
        "  type     float",
        "  meaning  Peak learning rate, reached after warmup.",
        "  set by   schema default",
    ]


def test_the_experiment_and_the_command_line_are_named_where_they_set_a_key():
    lines = render(["train", "+exp=smoke", "train.seed=7"])
    assert block(lines, "train.max_steps")[-1] == "  set by   conf/exp/smoke.yaml"
    assert block(lines, "train.eval_batches")[-1] == "  set by   schema default"
    assert block(lines, "train.seed")[0] == "train.seed = 7"
    assert block(lines, "train.seed")[-1] == "  set by   command line"


def test_a_group_shows_its_preset_and_choices():
    lines = render(["parallelism", "+exp=gpt_1b"])
    assert lines[0] == "parallelism = single  (config group)"
    assert lines[1].startswith("  choices  3d, cp2, ") and "zero3_offload" in lines[1]
    assert lines[3] == "  set by   conf/config.yaml"
    assert block(lines, "parallelism.dp_replicate")[0] == "parallelism.dp_replicate = 1  (${cluster.nodes})"
    assert block(lines, "parallelism.dp_shard") == [
        "parallelism.dp_shard = 8",
        "  default  1",
        "  range    >= 1",
        "  type     int",
        "  meaning  FSDP2 sharding degree.",
        "  set by   conf/exp/gpt_1b.yaml",
    ]
    assert "  choices  native, deepspeed" in block(lines, "parallelism.engine")
    assert render(["model", "+exp=gpt_1b"])[0] == "model = gpt_1b  (config group)"
    assert render(["model", "+exp=gpt_1b", "model=tiny"])[3] == "  set by   command line"


def test_the_preset_that_set_a_key():
    lines = render(["model", "model=gpt_7b"])
    assert block(lines, "model.d_ff")[-1] == "  set by   conf/model/gpt_7b.yaml"
    assert block(lines, "model.mlp")[-1] == "  set by   schema default"


def test_a_mapping_entry():
    lines = render(["comm.env.NCCL_IB_HCA", "comm=infiniband"])
    assert lines[0] == "comm.env.NCCL_IB_HCA = mlx5"
    assert lines[1].startswith("  meaning  an entry of comm.env: Environment variables exported")
    assert lines[2] == "  set by   conf/comm/infiniband.yaml"


@pytest.mark.parametrize(
    "selection, near",
    [("optim.lrr", "optim.lr"), ("optm", "optim"), ("parallelism.dp_shrd", "parallelism.dp_shard")],
)
def test_an_unknown_key_is_one_line_with_the_closest_key(selection, near, capsys):
    assert cli_main(["config", "show", selection]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"lmforge: config key '{selection}': is not a known key. Fix: did you mean '{near}'?\n")


def test_a_key_the_composition_lacks_is_refused():
    with pytest.raises(ConfigError) as e:
        render(["data.sources.kjv", "+exp=smoke"])
    assert str(e.value).startswith("config key 'data.sources.kjv': is not a known key")


def test_a_bad_override_is_the_usual_one_line(capsys):
    assert cli_main(["config", "show", "optim.lr", "optim.lrr=1"]) == 2
    assert (
        capsys.readouterr().err
        == "lmforge: config key 'optim.lrr': is not a known key. Fix: did you mean 'optim.lr'?\n"
    )


def test_usage_without_show(capsys):
    assert cli_main(["config"]) == 2
    assert capsys.readouterr().err.startswith("usage: lmforge config show")


@pytest.mark.parametrize("command", ["lmforge config show optim.lr", "lmforge config show parallelism +exp=gpt_1b"])
def test_the_docs_show_the_real_output(command):
    text = DOCS.read_text()
    shown = re.search(rf"```(?:console)?\n\$ {re.escape(command)}\n(.*?)```", text, re.S)
    assert shown, f"docs/configuration.md lacks the output of {command}"
    assert shown.group(1).rstrip("\n").split("\n") == render(command.split()[3:])


def test_two_selections_are_refused(capsys):
    assert cli_main(["config", "show", "optim", "train"]) == 2
    assert capsys.readouterr().err == (
        "lmforge: config show: expected one KEY or GROUP, got optim train. Fix: e.g. lmforge config show optim.lr\n"
    )
