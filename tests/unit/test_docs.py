"""The docs describe the tree as it is: architecture.md names every module, every relative link resolves inside the
repository, no link leaves it except to the primary sources below, and no file carries development-diary wording.

Each check is a function over a text or a tree, run on the repository and, as its negative control, on a planted
bad text or tree that it must reject.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, List

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "platform" / "lmforge"

# Links to outside the repository that a page may make: the primary sources of a format or tool lmforge builds on.
# Anything else is either copied into the repository or named without a link.
ALLOWED_EXTERNAL = (
    "https://hydra.cc",  # the configuration framework (configuration.md)
    "https://github.com/EleutherAI/lm-evaluation-harness",  # the task format evaluation reads (evaluation.md)
    "https://ui.perfetto.dev",  # the viewer of the traces the overlap probe keeps (collectives.md)
)

# Development-process wording: numbered sittings, tickets, "today", who measured what when. Dated history belongs
# in benchmarks/reports/YYYY-MM-<campaign>.md, whose names carry the date.
DIARY = re.compile(
    r"\bsessions?[ -]\d+"
    r"|\b(?:this|that|previous|next|other|earlier|later) sessions?\b"
    r"|\bissues? #?\d+"
    r"|\btickets?\b"
    r"|\btoday'?s?\b"
    r"|\bstop \d+"
    r"|\bsittings?\b"
    r"|\bengineers?\b",
    re.IGNORECASE,
)
DIARY_HEADING = re.compile(r"^#{1,6} .*\bsessions?\b", re.IGNORECASE)  # a sitting as a page section
# A path outside the repository (a workplace's notes, a home directory) that a reader of the tree cannot follow.
OUTSIDE_PATH = re.compile(r"(?:\.\./)+shared/|\bshared/notes/|(?<![\w.])/(?:work|home)/\w")
DIARY_ROOTS = ("platform", "conf", "docs", "tests", "benchmarks", "README.md")
DIARY_EXEMPT = ("benchmarks/reports", "benchmarks/results", "tests/unit/test_docs.py")  # dated history; this file
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".ini", ".txt"}

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
URL = re.compile(r"\b(?:https?|ftp)://[^\s)>\]`'\"]+|\bmailto:[^\s)>\]]+", re.IGNORECASE)


def prose(markdown: str) -> str:
    """The text of a page outside fenced blocks and code spans (code may quote paths and URLs as values)."""
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, code marks and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set:
    seen: dict = {}
    out = set()
    for line in FENCE.sub("", markdown).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def undocumented_modules(package: Path, architecture: str) -> List[str]:
    """The modules of ``package`` (every .py but __init__.py) whose path inside the package, e.g.
    ``model/gpt.py``, does not appear in ``architecture``."""
    missing = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(package).as_posix()
        if not re.search(r"(?<![\w/.])%s(?![\w])" % re.escape(rel), architecture):
            missing.append(rel)
    return missing


def bad_links(page: Path, repo: Path) -> List[str]:
    """Links of ``page`` that do not resolve: a relative target that is missing or outside ``repo``, an absolute
    path, an anchor that no heading of the target page has, or an external URL not in ``ALLOWED_EXTERNAL``."""
    text = page.read_text(encoding="utf-8")
    body = prose(text)
    problems = []
    for url in URL.findall(body):
        if not url.startswith(ALLOWED_EXTERNAL):
            problems.append(f"{page.name}: {url} leaves the repository (allowed: ALLOWED_EXTERNAL)")
    for target in LINK.findall(body):
        if URL.match(target) or target.startswith("mailto:"):
            continue  # judged above
        if target.startswith(("/", "file:")) or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            problems.append(f"{page.name}: {target} is not a path relative to the page")
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page.resolve()
        if repo.resolve() not in dest.parents and dest != repo.resolve():
            problems.append(f"{page.name}: {target} points outside the repository")
        elif not dest.exists():
            problems.append(f"{page.name}: {target} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{page.name}: {target} names no heading of {dest.name}")
    return problems


def pages(repo: Path) -> List[Path]:
    """The pages whose links are checked: README.md, docs/**/*.md and the reports."""
    found = [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]
    return found + sorted((repo / "benchmarks" / "reports").rglob("*.md"))


def text_files(repo: Path, roots: Iterable[str], exempt: Iterable[str]) -> List[Path]:
    exempt = tuple(exempt)
    out = []
    for root in roots:
        base = repo / root
        candidates = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for path in candidates:
            rel = path.relative_to(repo).as_posix()
            if "__pycache__" in rel or rel.startswith(exempt):
                continue
            if path.suffix in TEXT_SUFFIXES or path.name == "Makefile":
                out.append(path)
    return out


def diary_wording(repo: Path, roots: Iterable[str] = DIARY_ROOTS, exempt: Iterable[str] = DIARY_EXEMPT) -> List[str]:
    """``path:line: words`` for each line under ``roots`` that matches ``DIARY`` (or, in a page, ``DIARY_HEADING``)."""
    hits = []
    for path in text_files(repo, roots, exempt):
        patterns = (DIARY, DIARY_HEADING) if path.suffix == ".md" else (DIARY,)
        text = path.read_text(encoding="utf-8", errors="replace")
        if not (DIARY.search(text) or (len(patterns) > 1 and re.search(r"(?im)^#.*\bsession", text))):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            m = next((m for m in (pattern.search(line) for pattern in patterns) if m), None)
            if m:
                hits.append(f"{path.relative_to(repo).as_posix()}:{number}: {m.group(0)!r}")
    return hits


def outside_paths(repo: Path, roots: Iterable[str] = DIARY_ROOTS, exempt: Iterable[str] = DIARY_EXEMPT) -> List[str]:
    """``path:line: words`` for each line under ``roots`` that names a path outside the repository."""
    hits = []
    for path in text_files(repo, roots, exempt):
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            m = OUTSIDE_PATH.search(line)
            if m:
                hits.append(f"{path.relative_to(repo).as_posix()}:{number}: {m.group(0)!r}")
    return hits


# ------------------------------------------------------------------------------------------------ the repository


def test_architecture_names_every_module():
    missing = undocumented_modules(PACKAGE, (REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert not missing, f"docs/architecture.md does not name (as package/module.py): {missing}"


def test_every_link_resolves_inside_the_repository():
    problems = [p for page in pages(REPO) for p in bad_links(page, REPO)]
    assert not problems, "\n".join(problems)


def test_no_diary_wording():
    hits = diary_wording(REPO)
    assert not hits, "development-diary wording (state what is; dates go in report names):\n" + "\n".join(hits)


def test_no_path_outside_the_repository():
    hits = outside_paths(REPO)
    assert not hits, "paths outside the repository (say the fact where it is used):\n" + "\n".join(hits)


# ---------------------------------------------------------------------------------------------- negative controls


def test_a_module_missing_from_architecture_is_reported(tmp_path):
    pkg = tmp_path / "lmforge"
    (pkg / "model").mkdir(parents=True)
    for name in ("__init__.py", "model/__init__.py", "model/gpt.py", "model/rope.py", "cli.py"):
        (pkg / name).write_text("")
    text = "layer 2 `model/gpt.py` and `cli.py`; rope is described but not by its path; `model/ropes.py`"
    assert undocumented_modules(pkg, text) == ["model/rope.py"]
    assert undocumented_modules(pkg, text + " `model/rope.py`") == []


def test_broken_outside_and_unlisted_links_are_reported(tmp_path):
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "other.md").write_text("# Other page\n\n## Step speed\n")
    page = repo / "docs" / "page.md"
    good = "[a](other.md) [b](other.md#step-speed) [c](#top) [d](https://hydra.cc) `https://example.com` "
    page.write_text("# Top\n\n" + good + "\n\n```\nhttps://example.org/in/a/code/block\n```\n")
    assert bad_links(page, repo) == []
    page.write_text(
        "# Top\n\n[missing](gone.md) [anchor](other.md#no-such-heading) [up](../../outside.md) "
        "[abs](/work/notes.md) [web](https://example.com/x) and a bare https://example.org/y\n"
    )
    problems = bad_links(page, repo)
    assert len(problems) == 6, problems
    for part in ("gone.md", "no-such-heading", "outside.md", "/work/notes.md", "example.com/x", "example.org/y"):
        assert any(part in p for p in problems), (part, problems)


def test_diary_wording_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "reports").mkdir(parents=True)
    (tmp_path / "docs" / "clean.md").write_text("# Step speed\n\nThe engine step is 72% of the GEMM rate.\n")
    (tmp_path / "benchmarks" / "reports" / "2026-12-x.md").write_text("## Session 31\n")  # dated history: exempt
    (tmp_path / "docs" / "data.jsonl").write_text('{"text": "sitting today"}\n')  # corpus text: not scanned
    assert diary_wording(tmp_path, ("docs", "benchmarks"), ("benchmarks/reports",)) == []
    planted = [
        "## Session 31 (2026-12-02): two-pass RoPE",
        "measured in sessions 32-33",
        "as the previous session reported",
        "the goal figures of issue 17",
        "## Session moec: compiled cases",
        "today compile is on by default",
        "stop 28, idle",
        "before / after at one sitting",
        "while six engineers ran tests",
    ]
    (tmp_path / "docs" / "diary.md").write_text("\n".join(planted) + "\n")
    (tmp_path / "benchmarks" / "bench.py").write_text("# (docs/step-speed.md, session 33)\n")
    hits = diary_wording(tmp_path, ("docs", "benchmarks"), ("benchmarks/reports",))
    assert [h.split(":")[1] for h in hits if h.startswith("docs/diary.md")] == [str(i) for i in range(1, 10)], hits
    assert any(h.startswith("benchmarks/bench.py:1:") for h in hits), hits


def test_a_path_outside_the_repository_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ok.md").write_text("runs/smoke/, /tmp/books, docs/slurm.md, platform/lmforge/model/\n")
    assert outside_paths(tmp_path, ("docs",), ()) == []
    (tmp_path / "docs" / "bad.md").write_text("recipe: ../shared/notes/slurm.md\nsee /work/main/docs\n")
    assert outside_paths(tmp_path, ("docs",), ()) == [
        "docs/bad.md:1: '../shared/'",
        "docs/bad.md:2: '/work/m'",
    ]
