"""The commands the docs show, and the manifest that classes each one (tests/doc_commands.yaml).

A command is a line of a ```bash or ```sh block (continuation lines joined, a trailing ``# comment`` outside
quotes stripped, ``cmd1 && cmd2`` kept as one command, comment-only lines skipped) or the ``$ ``-prompted line of a
```console block, in README.md and docs/**/*.md. A line of an unlabelled or ```text block that looks like a command
(``suspects``) is a labelling defect: commands go in ```bash, transcripts in ```console, output in ```text.

The manifest classes every command (``CLASSES``); tests/unit/test_doc_manifest.py checks that it lists exactly the
commands the docs show, tests/e2e/test_doc_commands_validate.py composes and validates each ``validate`` entry,
tests/drills/test_doc_commands_cpu.py runs the ``cpu`` entries and tests/drills/test_doc_commands_slurm.py the
``slurm`` ones.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFEST = Path(__file__).resolve().parent / "doc_commands.yaml"
CLASSES = ("cpu", "validate", "slurm", "gpu", "ci", "external", "bench")
COMMAND_LABELS = ("bash", "sh")
TRANSCRIPT_LABELS = ("console",)
PLAIN_LABELS = ("", "text")  # blocks whose lines must not look like commands
PROMPT = "$ "
# The first word of a line that is a command (a path counts by its first component: launchers/x.sh, slurm/y.sh).
COMMAND_WORDS = ("lmforge", "python", "python3", "torchrun", "sbatch", "srun", "make", "bash", "pdsh", "sudo")
COMMAND_DIRS = ("launchers", "slurm", "benchmarks", ".venv")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
ENTRY_KEYS = {"command", "class", "world", "setup", "note", "test", "timeout_s", "exit"}


@dataclass(frozen=True)
class DocCommand:
    text: str
    path: str  # relative to the repository root
    line: int  # 1-based line of the command's first physical line

    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Block:
    label: str
    line: int  # 1-based line of the opening fence
    lines: Tuple[str, ...]


def doc_files(repo: Path = REPO) -> List[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]


def blocks(text: str) -> Iterator[Block]:
    """The fenced code blocks of a Markdown text (an unclosed fence runs to the end)."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, label, start = m.group(2), m.group(3).lower(), i
        body: List[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence[:3]):
            body.append(lines[i])
            i += 1
        yield Block(label, start + 1, tuple(body))
        i += 1


def strip_comment(line: str) -> str:
    """The line without a trailing ``# comment`` (a ``#`` at the start or after whitespace, outside quotes)."""
    quote: Optional[str] = None
    escaped = False
    for k, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip()
    return line.rstrip()


def logical_lines(lines: Sequence[str]) -> Iterator[Tuple[int, str]]:
    """(offset of the first physical line, the line with its continuations joined by one space)."""
    k = 0
    while k < len(lines):
        start, parts = k, [lines[k].rstrip()]
        while parts[-1].endswith("\\") and k + 1 < len(lines):
            parts[-1] = parts[-1][:-1].rstrip()
            k += 1
            parts.append(lines[k].strip())
        k += 1
        yield start, " ".join(p for p in parts if p)


def looks_like_command(line: str) -> bool:
    """Whether a line of a plain block reads as a command: its first word is a program the docs run."""
    stripped = line.strip()
    if stripped.startswith(PROMPT):
        return True
    first = stripped.split(None, 1)[0] if stripped else ""
    if re.match(r"^(\S+\s+){0,2}\S+:(\s|$)", stripped):  # output: "lmforge: config key", "lmforge data prepare: ..."
        return False
    if "/" in first:  # a script by its path; "launchers/   the launchers" (a layout listing) is not
        return first.split("/", 1)[0] in COMMAND_DIRS and not first.endswith("/")
    return first in COMMAND_WORDS


def commands_in(text: str, path: str) -> Tuple[List[DocCommand], List[DocCommand]]:
    """(the commands of a Markdown text, the lines of its plain blocks that look like commands)."""
    commands: List[DocCommand] = []
    suspects: List[DocCommand] = []
    for block in blocks(text):
        if block.label in COMMAND_LABELS:
            for offset, line in logical_lines(block.lines):
                command = strip_comment(line).strip()
                if command:
                    commands.append(DocCommand(command, path, block.line + 1 + offset))
        elif block.label in TRANSCRIPT_LABELS:
            for offset, line in logical_lines(block.lines):
                if line.startswith(PROMPT):
                    commands.append(
                        DocCommand(strip_comment(line[len(PROMPT) :]).strip(), path, block.line + 1 + offset)
                    )
        elif block.label in PLAIN_LABELS:
            for offset, line in logical_lines(block.lines):
                if looks_like_command(line):
                    suspects.append(DocCommand(line.strip(), path, block.line + 1 + offset))
    return commands, suspects


def doc_commands(repo: Path = REPO) -> Tuple[List[DocCommand], List[DocCommand]]:
    """Every command of README.md and docs/, and every plain-block line that looks like one."""
    commands: List[DocCommand] = []
    suspects: List[DocCommand] = []
    for f in doc_files(repo):
        c, s = commands_in(f.read_text(), str(f.relative_to(repo)))
        commands += c
        suspects += s
    return commands, suspects


def load_manifest(path: Path = MANIFEST) -> List[Dict]:
    """The manifest's entries in order (each a dict with at least ``command`` and ``class``)."""
    data = yaml.safe_load(path.read_text())
    entries = data.get("commands") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a mapping with a 'commands' list")
    return entries


def manifest_problems(entries: Sequence[Dict], commands: Sequence[DocCommand], repo: Path = REPO) -> List[str]:
    """Every way the manifest and the docs disagree, one line each (empty: they agree)."""
    problems: List[str] = []
    listed: Dict[str, Dict] = {}
    for k, entry in enumerate(entries):
        text = entry.get("command") if isinstance(entry, dict) else None
        if not isinstance(text, str):
            problems.append(f"manifest entry {k}: no 'command' string")
            continue
        unknown = set(entry) - ENTRY_KEYS
        if unknown:
            problems.append(f"manifest entry {text!r}: unknown key(s) {', '.join(sorted(unknown))}")
        if entry.get("class") not in CLASSES:
            problems.append(f"manifest entry {text!r}: class {entry.get('class')!r} is not one of {', '.join(CLASSES)}")
        if entry.get("class") == "validate" and not isinstance(entry.get("world"), int):
            problems.append(f"manifest entry {text!r}: a validate entry names its world size (world: N)")
        if entry.get("class") in ("gpu", "ci", "external") and not entry.get("test"):
            problems.append(f"manifest entry {text!r}: a {entry['class']} entry names the test that exercises it")
        if entry.get("class") == "bench" and not (entry.get("test") or entry.get("note")):
            problems.append(f"manifest entry {text!r}: a bench entry names its small-size test (or says it has none)")
        test = repo / str(entry.get("test") or "").split("::", 1)[0]
        if entry.get("test") and not test.is_file():
            problems.append(f"manifest entry {text!r}: its test {entry['test']} does not exist")
        if text in listed:
            problems.append(f"manifest entry {text!r}: listed twice")
        listed[text] = entry
    shown = {c.text for c in commands}
    for c in commands:
        if c.text not in listed:
            problems.append(f"{c.where()}: command not in tests/doc_commands.yaml: {c.text}")
    for text in listed:
        if text not in shown:
            problems.append(f"tests/doc_commands.yaml: stale entry, no doc shows it any more: {text}")
    return problems


OVERRIDE = re.compile(r"^(\+{1,2}|~)?[A-Za-z_][\w.@/-]*=")
GROUPS = ("model", "parallelism", "comm", "data", "optim", "train", "checkpoint", "logging", "cluster", "fault", "eval")
SBATCH_RESOURCES = {"--nodes": "cluster.nodes", "--gpus-per-node": "cluster.gpus_per_node"}


def _words(command: str) -> List[str]:
    """The command's words; a quoted word holding a whole command line (pdsh's) is split in turn."""
    words: List[str] = []
    for word in shlex.split(command):
        words += shlex.split(word) if " " in word else [word]
    return words


def _script_nodes(script: Path) -> Optional[str]:
    """The ``#SBATCH --nodes=N`` default of a batch script (None without one)."""
    m = re.search(r"^#SBATCH --nodes=(\d+)", script.read_text(), re.MULTILINE) if script.is_file() else None
    return m.group(1) if m else None


def hydra_overrides(command: str, repo: Path = REPO) -> List[str]:
    """The Hydra overrides of a command line as the launcher it names passes them on: every word of the form
    ``key=value`` (a config key with a dot, or a group), ``+key=value`` or ``~key=...``, in order. ``lmforge launch
    --nodes N`` becomes ``cluster.nodes=N``; ``sbatch``'s ``--nodes=N`` and ``--gpus-per-node=N`` become
    ``cluster.nodes`` and ``cluster.gpus_per_node`` (the node count defaulting to the script's ``#SBATCH --nodes``),
    as slurm/train.sh sets them from the allocation."""
    words = _words(command)
    out: List[str] = []
    if words and words[0] == "sbatch":
        script = next((w for w in words[1:] if w.endswith(".sh")), None)
        given = dict(w.split("=", 1) for w in words[1:] if w.startswith("--") and "=" in w)
        nodes = given.get("--nodes") or (_script_nodes(repo / script) if script else None)
        if nodes:
            out.append(f"cluster.nodes={nodes}")
        if "--gpus-per-node" in given:
            out.append(f"cluster.gpus_per_node={given['--gpus-per-node']}")
    k = 0
    while k < len(words):
        w = words[k]
        if w == "--nodes" and words[:2] == ["lmforge", "launch"] and k + 1 < len(words):
            out.append(f"cluster.nodes={words[k + 1]}")
            k += 2
            continue
        key = w.split("=", 1)[0].lstrip("+~")
        if OVERRIDE.match(w) and ("." in key or key in GROUPS or w[0] in "+~"):
            out.append(w)
        k += 1
    return out
