"""Evaluation tasks in lm-evaluation-harness's YAML format, read from local files (no hub).

A task file is the subset of lm-eval's task YAML that describes a log-likelihood task over local JSONL::

    task: austen_next_sentence
    dataset_path: json                       # the only loader: local JSON Lines
    dataset_kwargs:
      data_files: {test: austen_next_sentence.jsonl}   # relative paths: against the YAML's directory
    test_split: test                         # or validation_split
    fewshot_split: train                     # optional: where k-shot examples come from (default: the test split)
    output_type: multiple_choice             # or loglikelihood (cloze: is the target the greedy continuation?)
    doc_to_text: "{{context}}"               # Jinja over the document's fields, or a field name
    doc_to_choice: "{{choices}}"             # multiple_choice: a list (field name, Jinja giving a list, literal)
    doc_to_target: "{{label}}"               # an index into the choices, or the target text
    num_fewshot: 0
    target_delimiter: " "                    # lm-eval's defaults
    fewshot_delimiter: "\\n\\n"

Requests are built the way lm-eval builds them (``ConfigurableTask.construct_requests`` + its few-shot
context), so the in-loop numbers agree with ``lm_eval --model lmforge`` on the same file. Keys that would change
what is scored and are not implemented here (``process_docs``, filters, ``!function`` tags, ...) are refused,
never ignored. Every problem is a one-line ``ConfigError`` on ``eval.tasks`` naming the file.
"""

from __future__ import annotations

import ast
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml

from lmforge.config.errors import ConfigError
from lmforge.config.eval import EvalConfig

SHIPPED_DIR = Path(__file__).resolve().parent / "tasks"
KEY = "eval.tasks"
OUTPUT_TYPES = ("multiple_choice", "loglikelihood")
# Keys read here; keys lm-eval uses for reporting only are accepted and have no effect on scoring.
READ_KEYS = {
    "task",
    "dataset_path",
    "dataset_kwargs",
    "test_split",
    "validation_split",
    "fewshot_split",
    "output_type",
    "doc_to_text",
    "doc_to_choice",
    "doc_to_target",
    "num_fewshot",
    "target_delimiter",
    "fewshot_delimiter",
    "description",
    "training_split",
}
REPORTING_KEYS = {
    "metric_list",
    "metadata",
    "tag",
    "group",
    "dataset_name",
    "should_decontaminate",
    "doc_to_decontamination_query",
    "fewshot_config",
}
FEWSHOT_SEED = 1234  # lm-eval's default sampler seed


def _fail(where: Union[str, Path], reason: str, fix: str) -> ConfigError:
    return ConfigError(KEY, f"{where}: {reason}", fix)


def resolve_task_path(spec: str) -> Path:
    """A shipped task's name or a path to a task YAML."""
    path = Path(spec).expanduser()
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise _fail(
                spec,
                "no such task file",
                "give the path of an lm-eval task YAML, or a shipped task: " + ", ".join(shipped_task_names()),
            )
        return path
    shipped = SHIPPED_DIR / f"{spec}.yaml"
    if not shipped.is_file():
        raise _fail(
            spec,
            "is neither a .yaml file nor a shipped task",
            f"use a task YAML path or one of: {', '.join(shipped_task_names())}",
        )
    return shipped


def shipped_task_names() -> List[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


# ---- templates (lm-eval's rules: a field name, a Jinja template, or a literal) --------------------------
_ENV = None


def _jinja():
    global _ENV
    if _ENV is None:
        import re

        from jinja2 import StrictUndefined
        from jinja2.sandbox import SandboxedEnvironment

        _ENV = SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
        _ENV.filters["regex_replace"] = lambda s, pattern, repl: re.sub(pattern, repl, s)
    return _ENV


def apply_template(template: Any, doc: Dict[str, Any]) -> Any:
    """lm-eval's ``doc_to_*`` semantics: a field name returns the field; a Jinja string renders (a rendered list
    literal becomes a list, digits an int); a list or int is returned as given."""
    if not isinstance(template, str):
        return template
    if template in doc:
        return doc[template]
    text = _jinja().from_string(template).render(**doc)
    stripped = text.strip()
    if stripped.startswith("[") and stripped.endswith("]"):
        try:
            return ast.literal_eval(stripped)
        except (ValueError, SyntaxError):
            return text
    return text


@dataclass(frozen=True)
class Request:
    """One log-likelihood query: score ``continuation`` given ``context`` (lm-eval's ``Instance.args``)."""

    context: str
    continuation: str


@dataclass
class Task:
    name: str
    path: Path
    output_type: str
    docs: List[Dict[str, Any]]
    fewshot_docs: List[Dict[str, Any]]
    same_split: bool  # few-shot examples come from the scored split: the scored doc is never its own example
    doc_to_text: Any
    doc_to_target: Any
    doc_to_choice: Any = None
    num_fewshot: int = 0
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    description: str = ""
    _rnd: random.Random = field(default_factory=lambda: random.Random(FEWSHOT_SEED), repr=False)

    # ---- one document -----------------------------------------------------------------------------------
    def text(self, doc: Dict[str, Any]) -> str:
        return str(apply_template(self.doc_to_text, doc))

    def choices(self, doc: Dict[str, Any]) -> List[str]:
        value = apply_template(self.doc_to_choice, doc)
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise _fail(
                self.path,
                f"doc_to_choice gave {value!r} for a document, not a list of strings",
                "make doc_to_choice a field holding a list, or a Jinja template rendering one",
            )
        return value

    def target(self, doc: Dict[str, Any]) -> Union[int, str]:
        value = apply_template(self.doc_to_target, doc)
        if isinstance(value, str) and value.strip().isdigit() and self.output_type == "multiple_choice":
            return int(value.strip())
        return value

    def gold(self, doc: Dict[str, Any]) -> int:
        """multiple_choice: the index of the correct choice."""
        target, choices = self.target(doc), self.choices(doc)
        index = target if isinstance(target, int) else (choices.index(target) if target in choices else -1)
        if not 0 <= index < len(choices):
            raise _fail(
                self.path,
                f"doc_to_target gave {target!r}, not one of the {len(choices)} choices",
                "doc_to_target must be an index into doc_to_choice or one of its strings",
            )
        return index

    def target_text(self, doc: Dict[str, Any]) -> str:
        if self.output_type == "multiple_choice":
            return self.choices(doc)[self.gold(doc)]
        target = self.target(doc)
        if not isinstance(target, (str, int)):
            raise _fail(
                self.path,
                f"doc_to_target gave {target!r} for a document, not a target text",
                "make doc_to_target a field or template giving one string",
            )
        return str(target)

    # ---- lm-eval's request construction ------------------------------------------------------------------
    def fewshot_context(self, doc: Dict[str, Any]) -> str:
        """description + k examples (text + delimiter + target, fewshot_delimiter between) + the doc's text."""
        parts = []
        if self.num_fewshot:
            pool = self.fewshot_docs
            picked = self._rnd.sample(pool, min(len(pool), self.num_fewshot + (1 if self.same_split else 0)))
            if self.same_split:
                picked = [d for d in picked if d is not doc][: self.num_fewshot]
            parts = [self.text(d) + self.target_delimiter + self.target_text(d) for d in picked]
        body = self.fewshot_delimiter.join(parts + [self.text(doc)])
        return self.description + body

    def requests(self, doc: Dict[str, Any]) -> List[Request]:
        ctx = self.fewshot_context(doc)
        if self.output_type == "multiple_choice":
            return [Request(ctx, self.target_delimiter + c) for c in self.choices(doc)]
        return [Request(ctx, self.target_delimiter + self.target_text(doc))]

    def all_requests(self, limit: int = 0) -> List[List[Request]]:
        """Every document's requests, in order (the few-shot sampler is reset: the same contexts every call)."""
        self._rnd = random.Random(FEWSHOT_SEED)
        docs = self.docs[:limit] if limit else self.docs
        return [self.requests(d) for d in docs]


# ---- reading a task file -----------------------------------------------------------------------------------
def _read_jsonl(path: Path, where: Path) -> List[Dict[str, Any]]:
    if not path.is_file():
        raise _fail(
            where,
            f"data file {path} does not exist",
            "point dataset_kwargs.data_files at local JSONL files "
            "(relative paths are read against the task file's directory)",
        )
    docs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as err:
            raise _fail(where, f"{path}:{n} is not JSON ({err.msg})", "write one JSON object per line") from None
        if not isinstance(doc, dict):
            raise _fail(where, f"{path}:{n} is not a JSON object", "write one JSON object per line")
        docs.append(doc)
    if not docs:
        raise _fail(where, f"data file {path} holds no documents", "write one JSON object per line")
    return docs


def load_task(spec: str) -> Task:
    """Parse and check a task file and read its documents; every document's requests are built once here, so a
    bad template fails at start-up rather than at the first evaluation."""
    path = resolve_task_path(spec)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        reason = str(err).splitlines()[0]
        if "!function" in path.read_text(encoding="utf-8"):
            reason = "uses a '!function' tag (Python code in a task file)"
        raise _fail(
            path,
            f"cannot be read as a plain YAML task ({reason})",
            "use Jinja templates or field names for doc_to_*; Python hooks are not run",
        ) from None
    if not isinstance(raw, dict):
        raise _fail(path, "is not a YAML mapping", "write an lm-eval task file (task:, dataset_path:, ...)")
    unknown = sorted(set(raw) - READ_KEYS - REPORTING_KEYS)
    if unknown:
        raise _fail(
            path,
            f"uses keys lmforge does not implement: {', '.join(unknown)}",
            "remove them (they would change what is scored), or run the task with lm_eval --model lmforge",
        )
    for key in ("task", "dataset_path", "dataset_kwargs", "output_type", "doc_to_text", "doc_to_target"):
        if key not in raw:
            raise _fail(path, f"has no '{key}'", f"add '{key}:' (see docs/evaluation.md)")
    if raw["dataset_path"] != "json":
        raise _fail(
            path,
            f"dataset_path '{raw['dataset_path']}' is not local",
            "use dataset_path: json with dataset_kwargs.data_files naming local JSONL files (no hub downloads)",
        )
    if raw["output_type"] not in OUTPUT_TYPES:
        raise _fail(
            path,
            f"output_type '{raw['output_type']}' is not one of {', '.join(OUTPUT_TYPES)}",
            "score generation tasks with lm_eval --model lmforge",
        )
    if raw["output_type"] == "multiple_choice" and "doc_to_choice" not in raw:
        raise _fail(path, "is multiple_choice but has no 'doc_to_choice'", "add doc_to_choice: the list of choices")
    files = (raw.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, str):
        files = {"train": files}
    if not isinstance(files, dict) or not files:
        raise _fail(path, "dataset_kwargs.data_files is missing", "name a JSONL file per split: {test: FILE.jsonl}")
    split = raw.get("test_split") or raw.get("validation_split")
    if split is None:
        raise _fail(path, "has no test_split or validation_split", "name the split that is scored")
    if split not in files:
        raise _fail(path, f"split '{split}' is not in data_files ({', '.join(files)})", "add it to data_files")
    fewshot_split = raw.get("fewshot_split") or raw.get("training_split") or split
    if fewshot_split not in files:
        raise _fail(path, f"fewshot_split '{fewshot_split}' is not in data_files", "add it to data_files")

    def data(name: str) -> List[Dict[str, Any]]:
        file = Path(str(files[name])).expanduser()
        return _read_jsonl(file if file.is_absolute() else path.parent / file, path)

    docs = data(split)
    k = int(raw.get("num_fewshot") or 0)
    if k < 0:
        raise _fail(path, f"num_fewshot={k} is negative", "use 0 or more")
    task = Task(
        name=str(raw["task"]),
        path=path,
        output_type=raw["output_type"],
        docs=docs,
        fewshot_docs=docs if fewshot_split == split else data(fewshot_split),
        same_split=fewshot_split == split,
        doc_to_text=raw["doc_to_text"],
        doc_to_target=raw["doc_to_target"],
        doc_to_choice=raw.get("doc_to_choice"),
        num_fewshot=k,
        target_delimiter=str(raw.get("target_delimiter", " ")),
        fewshot_delimiter=str(raw.get("fewshot_delimiter", "\n\n")),
        description=str(raw.get("description") or ""),
    )
    if k and len(task.fewshot_docs) < k + int(task.same_split):
        raise _fail(
            path,
            f"num_fewshot={k} but the few-shot split has {len(task.fewshot_docs)} documents",
            "lower num_fewshot or add documents",
        )
    from jinja2 import TemplateError

    try:
        task.all_requests()
    except TemplateError as err:
        raise _fail(
            path, f"a doc_to_* template fails on a document ({err})", "use the documents' field names (Jinja {{field}})"
        ) from None
    return task


def load_tasks(specs: Sequence[str]) -> List[Task]:
    tasks = [load_task(s) for s in specs]
    names = [t.name for t in tasks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _fail(", ".join(dup), "two task files have the same task name", "give each task its own 'task:' name")
    return tasks


def check_eval_config(eval_cfg: EvalConfig) -> Optional[List[Task]]:
    """The eval section's check, before anything starts: the tasks parse and their data is there (ConfigError,
    one line). Run once per start by ``trainer.entry_checks``, which every entry point calls (``lmforge plan``,
    ``lmforge launch`` local and ``--slurm``, the Slurm prepare step, ``lmforge.train`` and sweep points before
    their data; the Trainer keeps the parsed tasks)."""
    if eval_cfg.batch_size < 1:
        raise ConfigError("eval.batch_size", f"{eval_cfg.batch_size} is not positive", "use 1 or more")
    if eval_cfg.limit < 0:
        raise ConfigError("eval.limit", f"{eval_cfg.limit} is negative", "use 0 (all documents) or a positive count")
    return load_tasks(eval_cfg.tasks) if eval_cfg.tasks else None


def describe(tasks: Optional[List[Task]]) -> str:
    """``lmforge plan``'s eval line for the tasks ``check_eval_config`` returned (``trainer.entry_checks``)."""
    if not tasks:
        return "eval       downstream tasks: none (eval.tasks)"
    return "eval       downstream tasks: " + ", ".join(f"{t.name} {len(t.docs)} docs" for t in tasks)
