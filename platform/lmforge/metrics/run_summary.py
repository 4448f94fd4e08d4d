"""The console's start block and end summary (rank 0): what a launch is about to do, and what it did.

    lmforge: run runs/smoke (launch 0, fresh start)
    lmforge: model smoke: 4.3M parameters, precision bf16-mixed on cpu
    lmforge: layout 1 process (gloo), mesh: single
    lmforge: plan 300 steps x 8,192 tokens = 2,457,600 tokens (300 to go)
    lmforge: W&B offline: runs/smoke/wandb/offline-run-20261204_201500-ab12cd34 (sync: wandb sync <that path>)
    ...
    lmforge: summary: steps 0 -> 300 of 300 in 312.4 s; loss 5.4810; median 9,812 tokens/s, MFU 11.2% (30 intervals)
    lmforge: validation loss, final (best at step): books 5.61 (5.61 at 300), code 4.92 (4.90 at 200)
    lmforge: goodput ...                                   (fault/goodput.py's line)
    lmforge: last checkpoint runs/smoke/checkpoints/step-00000300. Generate: lmforge generate runs/smoke --prompt ...

``RunSummary`` is a metrics sink: it sees the same train and eval records as the console and keeps only what the
summary reports. The lines are built by pure functions, so each wording is tested without training.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional


def count(n: float) -> str:
    """A parameter count the way model cards write it: 4.3M, 1.2B, 405B."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value >= 100 else f"{value:.1f}{unit}"
    return str(int(n))


@dataclass
class StartInfo:
    """What the start block says; the Trainer fills it from the validated config, the engine and the W&B sink."""

    run_dir: str
    launch: int
    resumed_from: Optional[int]
    model: str
    parameters: int
    precision: str
    device: str
    world_size: int
    backend: str
    mesh: Mapping[str, int]
    max_steps: int
    last_step: int  # train.stop_at_step when set, else max_steps
    tokens_per_step: int
    wandb: str  # wandb_line()'s text


def wandb_line(mode: Optional[str], url: Optional[str] = None, offline_dir: Optional[str] = None) -> str:
    """The W&B part of the start block: the URL online, the directory to sync offline, or off."""
    if mode == "online" and url:
        return f"online: {url}"
    if mode == "offline" and offline_dir:
        return f"offline: {offline_dir} (sync: wandb sync {offline_dir})"
    if mode in ("online", "offline"):
        return mode
    return "off (logging.wandb.mode, or WANDB_MODE=disabled)"


def mesh_text(mesh: Mapping[str, int]) -> str:
    """The mesh's dimensions above 1 (``dp_shard 4 x tp 2``), or ``single``."""
    return " x ".join(f"{name} {size}" for name, size in mesh.items() if size > 1) or "single"


def run_info(info: StartInfo, toolchain: Mapping[str, Optional[str]], nodes: List[str]) -> dict:
    """What a dashboard keeps about the launch (W&B's config and summary under ``run_info``): the start block's
    facts as values, the versions the numbers depend on and the nodes it ran on."""
    return {
        "model": info.model,
        "parameters": info.parameters,
        "precision": info.precision,
        "device": info.device,
        "world_size": info.world_size,
        "backend": info.backend,
        "mesh": mesh_text(info.mesh),
        **{f"mesh/{name}": size for name, size in info.mesh.items()},
        "tokens_per_step": info.tokens_per_step,
        "tokens_planned": info.max_steps * info.tokens_per_step,
        "launch": info.launch,
        "resumed_from": info.resumed_from,
        **dict(toolchain),
        "nodes": list(nodes),
    }


def start_block(info: StartInfo) -> List[str]:
    """The lines a launch prints before its first step."""
    start = 0 if info.resumed_from is None else info.resumed_from
    how = "fresh start" if info.resumed_from is None else f"continues at step {info.resumed_from}"
    processes = f"{info.world_size} process{'es' if info.world_size != 1 else ''}"
    dims = mesh_text(info.mesh)
    stop = f", stopping at step {info.last_step}" if info.last_step < info.max_steps else ""
    total = info.max_steps * info.tokens_per_step
    return [
        f"lmforge: run {info.run_dir} (launch {info.launch}, {how})",
        f"lmforge: model {info.model}: {count(info.parameters)} parameters, precision {info.precision} on "
        f"{info.device}",
        f"lmforge: layout {processes} ({info.backend}), mesh: {dims}",
        f"lmforge: plan {info.max_steps:,} steps x {info.tokens_per_step:,} tokens = {total:,} tokens "
        f"({max(0, info.last_step - start):,} to go{stop})",
        f"lmforge: W&B {info.wandb}",
    ]


@dataclass
class _Best:
    final: float
    final_step: int
    best: float
    best_step: int


@dataclass
class RunSummary:
    """A sink keeping what the end summary reports: the last train record, tokens/s and MFU of every logged
    interval, and per validation source its final and best loss with their steps."""

    last_step: Optional[int] = None
    last_loss: Optional[float] = None
    tokens_per_s: List[float] = field(default_factory=list)
    mfu: List[float] = field(default_factory=list)
    validation: Dict[str, _Best] = field(default_factory=dict)

    def log(self, record: dict) -> None:
        kind = record.get("kind", "train")
        if kind == "eval":
            self._eval(record)
        elif kind == "train":
            self.last_step, self.last_loss = record.get("step"), record.get("loss")
            if record.get("tokens_per_s"):
                self.tokens_per_s.append(float(record["tokens_per_s"]))
            if record.get("mfu") is not None:
                self.mfu.append(float(record["mfu"]))

    def _eval(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if not (key.startswith("val/") and key.endswith("/loss")):
                continue
            source, loss = key[len("val/") : -len("/loss")], float(value)
            seen = self.validation.get(source)
            if seen is None or loss < seen.best:
                best, best_step = loss, step
            else:
                best, best_step = seen.best, seen.best_step
            self.validation[source] = _Best(loss, step, best, best_step)

    def event(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def lines(self, *, start_step: int, end_step: int, max_steps: int, wall_s: float) -> List[str]:
        """The summary's lines (before the goodput line): steps and time, loss, throughput, validation."""
        head = f"lmforge: summary: steps {start_step} -> {end_step} of {max_steps} in {wall_s:.1f} s"
        if self.last_loss is not None:
            head += f"; loss {self.last_loss:.4f}"
        if self.tokens_per_s:
            head += f"; median {statistics.median(self.tokens_per_s):,.0f} tokens/s"
            if self.mfu:
                head += f", MFU {statistics.median(self.mfu):.1%}"
            head += f" ({len(self.tokens_per_s)} interval{'s' if len(self.tokens_per_s) != 1 else ''})"
        out = [head]
        if self.validation:
            parts = [f"{source} {v.final:.4f} ({v.best:.4f} at {v.best_step})" for source, v in self.validation.items()]
            out.append("lmforge: validation loss, final (best at step): " + ", ".join(parts))
        return out


def continue_hint(resume: str, step: int) -> str:
    """How a later launch picks this one up: ``train.resume=auto`` finds the run's newest checkpoint. A launch that
    named a checkpoint (a cooldown branch resumes its stable run's) must drop that path, or it starts there again."""
    auto = f"train.resume=auto resumes from step {step}"
    if resume in ("auto", "none"):
        return auto
    return f"with train.resume=auto instead of train.resume={resume}: {auto}"


def next_steps_line(
    run_dir: str, checkpoint: Optional[str], step: int, *, resume: str = "auto", max_steps: Optional[int] = None
) -> str:
    """A finished launch's last line: its newest checkpoint, how to generate from it and how to train further.
    ``max_steps``: the run's train.max_steps where it is not its last step (a batch ramp's full-batch steps)."""
    if checkpoint is None:
        return "lmforge: no checkpoint saved (checkpoint.enabled=false or checkpoint.save_final=false)"
    return (
        f"lmforge: last checkpoint {checkpoint}. Generate: lmforge generate {run_dir} --prompt TEXT; train further: "
        f"the same command with train.max_steps above {step if max_steps is None else max_steps} "
        f"({continue_hint(resume, step)})"
    )
