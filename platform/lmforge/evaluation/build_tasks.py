"""Build the shipped tasks from text every lmforge install has (deterministic; the output is committed).

    python -m lmforge.evaluation.build_tasks [OUT_DIR]     # default: lmforge/evaluation/tasks/

- ``austen_next_sentence``: two consecutive sentences of a paragraph of a Jane Austen novel (the embedded
  ``books`` corpus); choose the sentence that follows among four, the three distractors drawn from the same
  novel with a similar length. Chance: 25%.
- ``austen_word_order``: the same contexts and true sentences; the distractors are three shuffles of the true
  sentence's own words, so only word order tells the choices apart (a small model passes it once it learned
  English syntax). Chance: 25%.
- ``stdlib_next_line``: six consecutive non-blank lines of a Python standard-library module (the ``code``
  corpus's files); choose the line that follows among four, the distractors drawn from the same module.
  Chance: 25%. Built from the running interpreter's stdlib: the task file records the Python version.

All are 0-shot multiple choice by log-likelihood. Their text is from the training corpora (a check that a model
learned its data, not a held-out benchmark).
"""

from __future__ import annotations

import json
import lzma
import random
import re
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List

from lmforge.data.embedded import EMBEDDED_DIR
from lmforge.evaluation.tasks import SHIPPED_DIR

N_EXAMPLES = 200
N_CHOICES = 4
SEED = 19
SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"']))\s+(?=[\"']?[A-Z])")


ABBREVIATIONS = ("Mr.", "Mrs.", "Dr.", "St.", "Col.", "Capt.", "Sir.")


def _sentences(paragraph: str) -> List[str]:
    out: List[str] = []
    for piece in SENTENCE_END.split(" ".join(paragraph.split())):
        if out and out[-1].endswith(ABBREVIATIONS):  # "Mr. Woodhouse" is one sentence
            out[-1] += " " + piece
        else:
            out.append(piece)
    return [s.strip() for s in out if s.strip()]


def _similar(pool: List[str], true: str, rnd: random.Random, k: int) -> List[str]:
    """``k`` distinct strings from ``pool`` (not ``true``) of a length within a factor 1.5 of it, else any."""
    near = sorted({s for s in pool if s.strip() != true.strip() and 2 / 3 <= len(s) / max(len(true), 1) <= 1.5})
    if len(near) < k:
        near = sorted({s for s in pool if s.strip() != true.strip()})
    return rnd.sample(near, k)


def _example(context: str, true: str, distractors: List[str], rnd: random.Random) -> Dict:
    label = rnd.randrange(N_CHOICES)
    choices = list(distractors)
    choices.insert(label, true)
    return {"context": context, "choices": choices, "label": label}


def austen_examples(n: int = N_EXAMPLES) -> List[Dict]:
    rnd = random.Random(SEED)
    books = sorted(EMBEDDED_DIR.glob("*.txt.xz"))
    per_book = [n // len(books) + (1 if i < n % len(books) else 0) for i in range(len(books))]
    out = []
    for path, count in zip(books, per_book):
        text = lzma.decompress(path.read_bytes()).decode("utf-8")
        triples, pool = [], []
        for paragraph in re.split(r"\n\s*\n", text):
            sents = _sentences(paragraph)
            ok = [4 <= len(s.split()) <= 35 for s in sents]
            pool += [s for s, good in zip(sents, ok) if good and len(s.split()) >= 6]
            for i in range(2, len(sents)):
                if ok[i - 2] and ok[i - 1] and ok[i] and len(sents[i].split()) >= 6:
                    triples.append((sents[i - 2] + " " + sents[i - 1], sents[i]))
        for context, true in rnd.sample(triples, count):
            out.append(_example(context, true, _similar(pool, true, rnd, N_CHOICES - 1), rnd))
    return out


def _shuffled(sentence: str, rnd: random.Random, k: int) -> List[str]:
    """``k`` distinct orders of the sentence's words other than its own (same words, same characters)."""
    words, seen, out = sentence.split(), {sentence}, []
    for _ in range(100 * k):
        order = rnd.sample(words, len(words))
        candidate = " ".join(order)
        if candidate not in seen:
            seen.add(candidate)
            out.append(candidate)
            if len(out) == k:
                break
    return out


def austen_word_order_examples(n: int = N_EXAMPLES) -> List[Dict]:
    """The next sentence of an Austen paragraph against three shuffles of its own words: the choices differ only
    in word order (same words, same length), so a model scores above chance only if it learned English syntax."""
    rnd = random.Random(SEED + 1)
    out = []
    for doc in austen_examples(n):
        true = doc["choices"][doc["label"]]
        out.append(_example(doc["context"], true, _shuffled(true, rnd, N_CHOICES - 1), rnd))
    return out


def stdlib_files() -> List[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(stdlib.glob("*.py")) if not p.name.startswith(("test", "_"))]


def stdlib_examples(n: int = N_EXAMPLES, context_lines: int = 6) -> List[Dict]:
    rnd = random.Random(SEED)
    out = []
    files = [p for p in stdlib_files() if p.stat().st_size > 4000]
    for path in rnd.sample(files, min(len(files), n)):
        lines = [ln.rstrip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines()]
        lines = [ln for ln in lines if ln.strip() and len(ln) <= 100]
        usable = [ln for ln in lines if len(ln.strip()) >= 8]
        if len(lines) < context_lines + 10 or len(set(usable)) < 10:
            continue
        for _ in range(2):
            if len(out) >= n:
                return out
            i = rnd.randrange(context_lines, len(lines))
            true = lines[i]
            if len(true.strip()) < 8:
                continue
            out.append(
                _example("\n".join(lines[i - context_lines : i]), true, _similar(usable, true, rnd, N_CHOICES - 1), rnd)
            )
    return out[:n]


TASKS = {
    "austen_next_sentence": {
        "build": austen_examples,
        "target_delimiter": " ",
        "about": "choose the next sentence of a Jane Austen paragraph (4 choices)",
    },
    "austen_word_order": {
        "build": austen_word_order_examples,
        "target_delimiter": " ",
        "about": "choose the next sentence of a Jane Austen paragraph among shuffles of its words (4 choices)",
    },
    "stdlib_next_line": {
        "build": stdlib_examples,
        "target_delimiter": "\n",
        "about": "choose the next line of a Python standard-library module (4 choices)",
    },
}


def task_yaml(name: str) -> str:
    spec = TASKS[name]
    meta = {"built_by": "python -m lmforge.evaluation.build_tasks", "about": spec["about"], "chance": 0.25}
    if name == "stdlib_next_line":
        meta["python"] = f"{sys.version_info.major}.{sys.version_info.minor}"
    lines = [
        f"# {spec['about']}; built by lmforge/evaluation/build_tasks.py (do not edit by hand)",
        f"task: {name}",
        "dataset_path: json",
        "dataset_kwargs:",
        f"  data_files: {{test: {name}.jsonl}}",
        "test_split: test",
        "output_type: multiple_choice",
        "doc_to_text: context",
        "doc_to_choice: choices",
        "doc_to_target: label",
        "num_fewshot: 0",
        f"target_delimiter: {json.dumps(spec['target_delimiter'])}",
        "metric_list:",
        "  - metric: acc",
        "  - metric: acc_norm",
        "metadata:",
    ]
    lines += [f"  {k}: {json.dumps(v)}" for k, v in meta.items()]
    return "\n".join(lines) + "\n"


def build(out_dir: Path = SHIPPED_DIR) -> List[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, spec in TASKS.items():
        docs = spec["build"]()
        (out_dir / f"{name}.jsonl").write_text(
            "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8"
        )
        (out_dir / f"{name}.yaml").write_text(task_yaml(name), encoding="utf-8")
        written += [out_dir / f"{name}.yaml", out_dir / f"{name}.jsonl"]
    return written


if __name__ == "__main__":
    for p in build(Path(sys.argv[1]) if len(sys.argv) > 1 else SHIPPED_DIR):
        print(p)
