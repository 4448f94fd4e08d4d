"""Every training/planning command shown in the docs composes and validates with the world size it implies.

The commands are read from ``docs/*.md`` and ``README.md`` (fenced code lines and inline code spans that
start with one):
``lmforge train|plan|launch``, ``python -m lmforge.train``, ``torchrun ... -m lmforge.train`` and
``sbatch ... slurm/train.sh``, ``launchers/torchrun_{local,multinode}.sh``. Each is parsed with the real argument parsers (torchrun's, ``lmforge launch``'s),
composed with Hydra exactly as the trainer composes it, and passed to ``config.validate.validate`` with the
world size the command starts:

    lmforge train / python -m lmforge.train      1 process
    torchrun --nnodes=N --nproc_per_node=P       N * P
    lmforge launch --nproc P                     P (default cluster.gpus_per_node, as the launcher does)
    lmforge launch --slurm [--nodes N]           (N or cluster.nodes) * cluster.gpus_per_node; N sets cluster.nodes
    sbatch [--nodes=N] slurm/train.sh            the same (the prepare step's SLURM_NNODES -> cluster.nodes)
    launchers/torchrun_local.sh --nproc P        P (default cluster.gpus_per_node)
    launchers/torchrun_multinode.sh --nnodes N --nproc P   N * P (default P: cluster.gpus_per_node)
    lmforge plan                                 cluster.nodes * cluster.gpus_per_node (as plan_cli does)

Templates with placeholders (``<overrides>``, ``...``, ``[more overrides]``, ``+exp=NAME``) are left out.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
from omegaconf import OmegaConf

from lmforge.config.compose import compose
from lmforge.config.errors import ConfigError
from lmforge.config.validate import validate

REPO = Path(__file__).resolve().parents[2]
SCRIPT_NODES = int(re.search(r"^#SBATCH --nodes=(\d+)$", (REPO / "slurm" / "train.sh").read_text(), re.M).group(1))
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
START = re.compile(
    r"^(?:\$ )?((?:\S*/)?lmforge (?:train|plan|launch)(?=\s|$)|python -m lmforge\.train(?=\s|$)|torchrun\s.*-m lmforge\.train\b|sbatch\s"
    r"|(?:\S*/)?launchers/torchrun_(?:local|multinode)\.sh\s)"
)
# <overrides>, ..., [more overrides], $VAR, +exp=NAME / +exp=X
PLACEHOLDER = re.compile(r"<|>|…|\.\.\.|\[|\]|\$|=[A-Z]+(?:\s|$)")


@dataclass
class DocCommand:
    where: str  # file:line
    text: str
    overrides: List[str]
    processes: Optional[int]  # fixed by the command line; None: nodes * cluster.gpus_per_node
    nodes: Optional[int] = None  # sbatch --nodes / launch --nodes; None: cluster.nodes


def _candidates(path: Path) -> List[Tuple[int, str]]:
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        spans = re.findall(r"`([^`]+)`", line)
        if fenced:
            spans.append(line.split("  #")[0].split(" # ")[0])
        out.extend((n, s.strip()) for s in spans)
    return out


def parse_command(where: str, text: str) -> Optional[DocCommand]:
    """The layout a documented command starts, or None when ``text`` is not a training/planning command."""
    m = START.search(text)
    if not m:
        return None
    text = text[m.start(1) :]
    if PLACEHOLDER.search(text) or len(text.split()) <= (3 if text.startswith("python") else 2):
        return None  # a template, or the bare command's name in prose
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise AssertionError(f"{where}: `{text}` is not a shell command line: {e}") from None
    head = argv[0].rsplit("/", 1)[-1]
    if head == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        assert args.module and args.training_script == "lmforge.train", f"{where}: `{text}`: not -m lmforge.train"
        nnodes = int(str(args.nnodes).split(":")[-1])
        return DocCommand(where, text, list(args.training_script_args), nnodes * int(args.nproc_per_node))
    if head == "sbatch":
        script = next((i for i, a in enumerate(argv) if a.endswith("slurm/train.sh")), None)
        if script is None:
            return None
        nodes = [a.split("=", 1)[1] for a in argv[1:script] if a.startswith("--nodes=")]
        # without --nodes, the batch script's own #SBATCH --nodes line is the allocation
        return DocCommand(where, text, argv[script + 1 :], None, int(nodes[0]) if nodes else SCRIPT_NODES)
    if head.startswith("torchrun_") and head.endswith(".sh"):  # launchers/: options, then -- and the overrides
        split = argv.index("--") if "--" in argv else len(argv)
        opts = dict(zip(argv[1:split:2], argv[2:split:2]))
        nproc = int(opts.get("--nproc", -1))  # -1: cluster.gpus_per_node per node, as the prepare step does
        return DocCommand(where, text, argv[split + 1 :], nproc * int(opts.get("--nnodes", 1)))
    if head == "python":
        return DocCommand(where, text, argv[3:], 1)
    verb, rest = argv[1], argv[2:]
    if verb == "train":
        if any(a == "--config-dir" or a.startswith("--config-dir=") for a in rest):
            return None  # another config tree (an import's), composed where it exists: the docs' cpu drill runs it
        unknown = [a for a in rest if a.startswith("-")]
        assert not unknown, f"{where}: `{text}`: option {unknown[0]} not handled by this test"
        return DocCommand(where, text, rest, 1)
    if verb == "plan":
        return DocCommand(where, text, [a for a in rest if a not in ("--json", "--search")], None)
    from lmforge.launch.cli import parser

    args, overrides = parser().parse_known_args(rest)
    if args.slurm:
        return DocCommand(where, text, overrides, None, args.nodes)
    return DocCommand(where, text, overrides, args.nproc or -1)  # -1: cluster.gpus_per_node, as launch does


def doc_commands() -> List[DocCommand]:
    found = []
    for path in DOCS:
        for n, span in _candidates(path):
            cmd = parse_command(f"{path.relative_to(REPO)}:{n}", span)
            if cmd is not None:
                found.append(cmd)
    return found


def world_size(cmd: DocCommand, cfg) -> int:
    per_node = int(OmegaConf.select(cfg, "cluster.gpus_per_node"))
    if cmd.processes is not None and cmd.processes < 0:  # -N: N nodes of cluster.gpus_per_node
        return -cmd.processes * per_node
    if cmd.processes is not None:
        return cmd.processes
    nodes = cmd.nodes if cmd.nodes is not None else int(OmegaConf.select(cfg, "cluster.nodes"))
    return nodes * per_node


def check_command(cmd: DocCommand) -> None:
    overrides = list(cmd.overrides)
    if cmd.processes is None and cmd.nodes is not None:
        # A Slurm job's node count feeds cluster.nodes in the batch script's prepare step, as here.
        from lmforge.launch.allocation import nodes_override

        extra = nodes_override(overrides, {"SLURM_NNODES": str(cmd.nodes)})
        overrides += [extra] if extra else []
    cfg = compose(overrides)
    validate(cfg, world_size=world_size(cmd, cfg))


COMMANDS = doc_commands()


def test_the_docs_show_layout_commands():
    """The extraction itself: the docs' parallel layouts (3-D, FSDP, DeepSpeed, plan, Slurm) are all found."""
    texts = " | ".join(c.text for c in COMMANDS)
    assert len(COMMANDS) >= 20, texts
    for needle in (
        "parallelism=3d",
        "parallelism=zero3_offload",
        "lmforge plan",
        "sbatch",
        "lmforge launch --slurm",
        "lmforge launch --nproc 2",
        "launchers/torchrun_local.sh",
        "launchers/torchrun_multinode.sh",
    ):
        assert needle in texts, f"no documented command with {needle!r}: {texts}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.where} {c.text}" for c in COMMANDS])
def test_documented_command_validates(cmd, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        check_command(cmd)
    except ConfigError as e:
        pytest.fail(
            f"{cmd.where}: `{cmd.text}` fails validation with world size {world_size(cmd, compose(cmd.overrides))}: {e}"
        )


def test_negative_control_the_old_3d_example_fails():
    """The 3-D example as docs/parallelism.md showed it: gpt_1b's dp_shard=8 wins over the preset's 2, so
    pp2 x dp8 x tp2 = 32 ranks on 8 processes; the same check must refuse it."""
    cmd = parse_command(
        "old", "torchrun --nproc_per_node=8 -m lmforge.train +exp=gpt_1b parallelism=3d parallelism.pp_microbatches=8"
    )
    assert cmd.processes == 8
    with pytest.raises(
        ConfigError, match=r"dp_replicate\*dp_shard\*tp\*pp = 1\*8\*2\*2 = 32 but the job has world size 8"
    ):
        check_command(cmd)
    # Slurm: the allocation's node count is the one source of truth; a different explicit cluster.nodes is refused.
    cmd = parse_command("old", "sbatch --nodes=4 slurm/train.sh +exp=gpt_1b cluster.nodes=2")
    with pytest.raises(ConfigError, match=r"is 2 on the command line but the job has 4 nodes \(SLURM_NNODES\)"):
        check_command(cmd)
