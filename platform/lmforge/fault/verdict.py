"""A worker's verdict: why it stopped, written to the run directory before it exits, read by every launcher.

An exit code alone does not survive torchrun (its agent exits 1 whatever the worker returned), so each
worker that ends in error writes ``<run>/verdicts/rank<r>.json`` (tmp + rename) with the kind, rank, step,
message, exit code, time and restart counts. The launchers read it:

* ``lmforge.launch.agent`` (torchrun's elastic agent with a restart policy) does not restart a worker
  group when any rank's verdict is deterministic, and exits with that verdict's exit code;
* ``lmforge.fault.retry`` (``jobctl after`` in slurm/train.sh, ``lmforge launch``) stops instead of
  requeueing, with the verdict's message in the job log and its exit code.

Deterministic kinds cannot succeed on a retry: ``config_error``, ``layout_error``, ``data_error`` (exit 2),
``diverged`` (45), ``repeated_crash`` (46: a crash at the same step as a crash of an earlier attempt; never a lost
peer, fault/peer_loss.py) and
``corrupted`` (47: data-parallel replicas differ; fault/consistency.py; a requeue that excludes the hosts the check
names retries it elsewhere: lmforge.fault.retry).
Retryable kinds: ``crash`` (an uncaught exception, exit 1), ``preempted`` and ``hang`` (watchdog, 43).

Each launcher attempt starts clean: the launcher moves the previous attempt's verdicts into
``verdicts/history.jsonl`` (:func:`archive`). Crash tracebacks are kept in ``<run>/crashes/`` for the
whole run, because the repeated-crash rule compares a crash with the crashes of earlier attempts.
"""

from __future__ import annotations

import enum
import json
import os
import socket
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

from lmforge.config.errors import ActionableError, ConfigError
from lmforge.fault.exitcodes import BAD_INPUT_EXIT_CODE, REPEATED_CRASH_EXIT_CODE
from lmforge.fault.peer_loss import lost_peer
from lmforge.runtime.device_contract import DeviceContractError
from lmforge.runtime.env_vars import read, read_int, slurm_restart_count, torchrun_restart_count
from lmforge.runtime.file_modes import make_dir, open_append, open_write, write_text
from lmforge.runtime.rundir import RunPaths
from lmforge.runtime.secrets import redact_text

HISTORY_FILE = "history.jsonl"
PEER_LOST_TAG = "peer_lost"  # in the name of a lost peer's crash record, which the repeated-crash rule never matches


class VerdictKind(str, enum.Enum):
    CONFIG_ERROR = "config_error"
    LAYOUT_ERROR = "layout_error"
    DATA_ERROR = "data_error"
    DIVERGED = "diverged"
    REPEATED_CRASH = "repeated_crash"
    CORRUPTED = "corrupted"
    CRASH = "crash"
    PREEMPTED = "preempted"
    HANG = "hang"

    @property
    def deterministic(self) -> bool:
        return self in DETERMINISTIC


DETERMINISTIC = frozenset(
    {
        VerdictKind.CONFIG_ERROR,
        VerdictKind.LAYOUT_ERROR,
        VerdictKind.DATA_ERROR,
        VerdictKind.DIVERGED,
        VerdictKind.REPEATED_CRASH,
        VerdictKind.CORRUPTED,
    }
)


@dataclass
class Verdict:
    kind: VerdictKind
    rank: int
    step: int
    message: str
    exit_code: int
    time: float = field(default_factory=time.time)
    torchrun_restart: int = 0
    slurm_restart: int = 0
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    tracebacks: List[str] = field(default_factory=list)

    @property
    def deterministic(self) -> bool:
        return self.kind.deterministic

    def summary(self) -> str:
        return f"{self.kind.value} on rank {self.rank} at step {self.step} (exit {self.exit_code}): {self.message}"

    def to_json(self) -> dict:
        return {**asdict(self), "kind": self.kind.value, "deterministic": self.deterministic}

    @classmethod
    def from_json(cls, d: dict) -> "Verdict":
        names = cls.__dataclass_fields__
        return cls(**{k: (VerdictKind(v) if k == "kind" else v) for k, v in d.items() if k in names})


def verdicts_dir(run_dir: Path) -> Path:
    return RunPaths(Path(run_dir)).verdicts


def crashes_dir(run_dir: Path) -> Path:
    return RunPaths(Path(run_dir)).crashes


def env_rank() -> int:
    """RANK as the launcher set it (0 when unset or not a number: a verdict is written whatever the environment)."""
    try:
        return read_int("RANK", 0)
    except ValueError:
        return 0


def write(run_dir: Path, verdict: Verdict) -> Path:
    """Atomically write ``verdicts/rank<r>.json`` (tmp + fsync + rename); secret values are redacted."""
    verdict.message = redact_text(verdict.message)
    d = make_dir(verdicts_dir(run_dir))
    path = d / f"rank{verdict.rank}.json"
    tmp = d / f".rank{verdict.rank}.json.{os.getpid()}.tmp"
    with open_write(tmp) as fh:
        json.dump(verdict.to_json(), fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def read_all(run_dir: Path) -> List[Verdict]:
    """This attempt's verdicts, by rank; unreadable files are skipped (a verdict is advice, not state)."""
    out = []
    for p in sorted(verdicts_dir(run_dir).glob("rank*.json")):
        try:
            out.append(Verdict.from_json(json.loads(p.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(out, key=lambda v: (v.time, v.rank))


def deciding(run_dir: Path) -> Optional[Verdict]:
    """The verdict that decides the attempt: the earliest deterministic one, else None."""
    return next((v for v in read_all(run_dir) if v.deterministic), None)


def archive(run_dir: Path) -> int:
    """Start a new attempt: move the current verdicts into ``verdicts/history.jsonl``. Returns how many."""
    d = verdicts_dir(run_dir)
    moved = 0
    for p in sorted(d.glob("rank*.json")):
        try:
            text = json.dumps(json.loads(p.read_text()), sort_keys=True)
        except (OSError, ValueError):
            text = None
        try:
            p.unlink()
        except FileNotFoundError:
            continue
        if text is not None:
            with open_append(d / HISTORY_FILE) as fh:
                fh.write(text + "\n")
            moved += 1
    return moved


def classify(exc: BaseException) -> Optional[tuple]:
    """(kind, exit code, message) for an exception ending a worker; None for a clean or unknown exit."""
    kind = getattr(exc, "verdict_kind", None)
    if kind is not None:  # Diverged, Preempted: they carry their kind (and, as SystemExit, their exit code)
        code = int(exc.code or 0) if isinstance(exc, SystemExit) else 1
        return VerdictKind(kind), code, getattr(exc, "message", "") or str(exc)
    if isinstance(exc, ConfigError):
        key = getattr(exc, "key", "")
        if key.split(".")[0] == "parallelism":
            return VerdictKind.LAYOUT_ERROR, BAD_INPUT_EXIT_CODE, str(exc)
        if key.split(".")[0] == "data":
            return VerdictKind.DATA_ERROR, BAD_INPUT_EXIT_CODE, str(exc)
        return VerdictKind.CONFIG_ERROR, BAD_INPUT_EXIT_CODE, str(exc)
    # any other actionable refusal (a checkpoint file refused as unsafe, ...) and an environment that cannot give
    # the job the devices it names: the same input fails the same way on every attempt
    if isinstance(exc, (ActionableError, DeviceContractError)):
        return VerdictKind.CONFIG_ERROR, BAD_INPUT_EXIT_CODE, str(exc)
    if isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
        return None
    # any other exception is a crash, BaseException subclasses included (DCP's CheckpointException is one: a failed
    # checkpoint save or load must leave its verdict and traceback like any other crash)
    return VerdictKind.CRASH, 1, f"{type(exc).__name__}: {exc}"


def record_crash(run_dir: Path, rank: int, step: int, error: str, text: str, started: float) -> tuple:
    """Keep a crash's traceback in ``crashes/step-<step>-<error type>-rank<r>-t<ns>.txt``; return (its path,
    the paths of earlier attempts' crashes with the same step and error type, this rank's first).

    The same crash is the same exception type at the same step. A peer's secondary failure (a collective error
    after another rank died) is recorded under ``<error>-peer_lost`` by :func:`verdict_for`, so it neither matches
    nor is matched. A record older than ``started`` (when this worker began) comes from an earlier attempt: a
    launcher restarts a group only after every process of the previous one has ended."""
    d = make_dir(crashes_dir(run_dir))
    earlier = []
    for p in sorted(d.glob(f"step-{step:08d}-{error}-rank*.txt"), key=lambda p: f"-rank{rank}-" not in p.name):
        try:
            if p.stat().st_mtime < started:
                earlier.append(p)
        except FileNotFoundError:
            continue
    path = d / f"step-{step:08d}-{error}-rank{rank}-t{time.time_ns()}.txt"
    tmp = path.with_name(f".{path.name}.tmp")
    write_text(tmp, redact_text(text))
    os.replace(tmp, path)
    return path, earlier


def verdict_for(run_dir: Path, exc: BaseException, rank: int, step: int, started: float) -> Optional[Verdict]:
    """Classify ``exc``, apply the repeated-crash rule, write the verdict; None when nothing to record.

    A lost peer (fault/peer_loss.py: a communication error after another rank died) stays a retryable ``crash``:
    its traceback is kept, tagged ``peer_lost``, and it never counts toward, nor triggers, ``repeated_crash``."""
    found = classify(exc)
    if found is None:
        return None
    kind, code, message = found
    tracebacks: List[str] = []
    if kind is VerdictKind.CRASH:
        text = (
            f"rank {rank} step {step} pid {os.getpid()} host {socket.gethostname()} "
            f"torchrun restart {torchrun_restart_count()} slurm restart "
            f"{slurm_restart_count()}\n" + "".join(traceback.format_exception(exc))
        )
        error = "".join(c for c in type(exc).__name__ if c.isalnum() or c == "_")
        peer_lost = lost_peer(exc)
        if peer_lost:
            error = f"{error}-{PEER_LOST_TAG}"
            message = f"{message} (a lost peer or network failure: never counted as a repeated crash)"
        path, earlier = record_crash(run_dir, rank, step, error, text, started)
        earlier = [] if peer_lost else earlier
        tracebacks = [str(p) for p in earlier[:1]] + [str(path)]
        if earlier:
            kind, code = VerdictKind.REPEATED_CRASH, REPEATED_CRASH_EXIT_CODE
            message = (
                f"the crash at step {step} happened before, in an earlier attempt ({earlier[0].name}): not "
                f"retried; {message}; tracebacks: {', '.join(tracebacks)}"
            )
    v = Verdict(
        kind,
        rank,
        step,
        message,
        code,
        torchrun_restart=torchrun_restart_count(),
        slurm_restart=slurm_restart_count(),
        tracebacks=tracebacks,
    )
    write(run_dir, v)
    return v


class VerdictRecorder:
    """``with VerdictRecorder(run_dir) as rec: ...``: an exception leaving the block is recorded as this rank's
    verdict (then re-raised). ``rec.step`` is a callable giving the current step (the trainer sets it)."""

    def __init__(self, run_dir: Path, rank: Optional[int] = None):
        self.run_dir = Path(run_dir)
        watched = read("LMFORGE_RUN_DIR")
        if watched and Path(watched).absolute() != self.run_dir.absolute():
            print(
                f"lmforge: warning: the launcher reads verdicts in {watched} (LMFORGE_RUN_DIR) but this run writes "
                f"them to {self.run_dir}: a deterministic failure would be retried; launch without overriding "
                f"hydra.run.dir",
                flush=True,
            )
        self.rank = env_rank() if rank is None else rank
        self.step: Callable[[], int] = lambda: 0
        self.started = time.time()
        self.verdict: Optional[Verdict] = None

    def __enter__(self) -> "VerdictRecorder":
        return self

    def __exit__(self, etype, exc, tb) -> bool:
        if exc is not None:
            try:
                step = int(self.step())
            except Exception:  # noqa: BLE001  a half-built trainer
                step = 0
            try:
                self.verdict = verdict_for(self.run_dir, exc, self.rank, step, self.started)
            except OSError as e:  # the run directory is unwritable: say so, keep the original error
                print(f"lmforge: could not write the verdict to {verdicts_dir(self.run_dir)}: {e}", flush=True)
        return False


def record_exit(run_dir: Path, kind: VerdictKind, rank: int, step: int, message: str, exit_code: int) -> None:
    """For paths that leave with ``os._exit`` (the watchdog): write the verdict, never raise."""
    try:
        write(
            run_dir,
            Verdict(
                kind,
                rank,
                step,
                message,
                exit_code,
                torchrun_restart=torchrun_restart_count(),
                slurm_restart=slurm_restart_count(),
            ),
        )
    except OSError:
        pass


__all__ = [
    "VerdictKind",
    "Verdict",
    "VerdictRecorder",
    "DETERMINISTIC",
    "write",
    "read_all",
    "deciding",
    "archive",
    "verdict_for",
    "record_exit",
]
