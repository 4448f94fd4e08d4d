"""The global batch's ramp by samples seen (``train.batch_size_schedule``), computed in exactly one place.

Megatron's rule (``--rampup-batch-size <start> <increment> <ramp samples>``): the batch grows from ``start`` to
``train.global_batch_size`` (G) in K = (G - start) / increment equal stages over ``ramp_samples`` samples; the step
that starts at ``consumed`` samples takes

    batch(consumed) = min(G, start + floor(consumed * K / ramp_samples) * increment)

sequences (integer arithmetic: no float rounding). The batch is a function of the samples consumed only, never of
the data-parallel size, so every layout and every resume walks the same steps over the same samples.

Rounding rule: nothing is rounded. ``start`` and ``increment`` must be multiples of micro_batch_size x
data-parallel size (then every stage is), and ``increment`` must divide G - start; anything else is refused
(``check_batch_ramp``), naming the key and the nearest valid values.

The run's length: ``train.max_steps`` counts full-batch steps, i.e. max_steps x G samples; the run takes the fewest
optimizer steps that reach them (``run_steps``). The last step is a whole batch, so a run may consume up to G - 1
samples past max_steps x G (``run_samples``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import List, Optional

from lmforge.config.errors import ConfigError
from lmforge.config.train import TrainConfig

KEY = "train.batch_size_schedule"


@dataclass(frozen=True)
class BatchRamp:
    start: int
    increment: int
    ramp_samples: int
    global_batch: int
    _ends: List[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ends, consumed = [0], 0  # ends[s]: samples consumed after s steps, for the steps inside the ramp
        while consumed < self.ramp_samples:
            consumed += self.batch_at(consumed)
            ends.append(consumed)
        object.__setattr__(self, "_ends", ends)

    @property
    def stages(self) -> int:
        return (self.global_batch - self.start) // self.increment

    @property
    def ramp_steps(self) -> int:
        """Optimizer steps that start inside the ramp (before ``ramp_samples`` samples are consumed)."""
        return len(self._ends) - 1

    def batch_at(self, consumed: int) -> int:
        """Global batch (sequences) of the step that starts after ``consumed`` samples."""
        stage = consumed * self.stages // self.ramp_samples
        return min(self.global_batch, self.start + stage * self.increment)

    def samples_before(self, step: int) -> int:
        """Samples consumed by the steps before ``step`` (0-based), i.e. where step ``step`` starts."""
        if step <= self.ramp_steps:
            return self._ends[step]
        return self._ends[-1] + (step - self.ramp_steps) * self.global_batch

    def describe(self, max_steps: int) -> str:
        """One line for the run's start block: the ramp's stages and what ``train.max_steps`` comes to."""
        steps = self.steps_to_reach(max_steps * self.global_batch)
        return (
            f"lmforge: batch ramp: {self.start} -> {self.global_batch} sequences by {self.increment} in "
            f"{self.stages} stages over {self.ramp_samples:,} samples ({self.ramp_steps} steps); "
            f"train.max_steps={max_steps} full-batch steps = {self.samples_before(steps):,} samples in {steps} "
            "optimizer steps"
        )

    def steps_to_reach(self, samples: int) -> int:
        """The fewest optimizer steps whose samples add up to at least ``samples``."""
        if samples <= self._ends[-1]:
            return bisect.bisect_left(self._ends, samples)
        return self.ramp_steps + -(-(samples - self._ends[-1]) // self.global_batch)


def batch_ramp(train: TrainConfig) -> Optional[BatchRamp]:
    """The run's ramp, or None when ``train.batch_size_schedule.start`` is 0 (checked: ``check_batch_ramp``)."""
    r = train.batch_size_schedule
    if r.start == 0:
        return None
    return BatchRamp(r.start, r.increment, r.ramp_samples, train.global_batch_size)


def run_steps(train: TrainConfig) -> int:
    """Optimizer steps of the whole run: ``train.max_steps``, or with a ramp the steps that reach its samples."""
    ramp = batch_ramp(train)
    return train.max_steps if ramp is None else ramp.steps_to_reach(train.max_steps * train.global_batch_size)


def run_steps_of(train: dict) -> int:
    """``run_steps`` of a recorded config's ``train`` section (a checkpoint sidecar's, ``config_dict``'s)."""
    r = train.get("batch_size_schedule") or {}
    if not r.get("start"):
        return int(train["max_steps"])
    ramp = BatchRamp(int(r["start"]), int(r["increment"]), int(r["ramp_samples"]), int(train["global_batch_size"]))
    return ramp.steps_to_reach(int(train["max_steps"]) * int(train["global_batch_size"]))


def run_samples(train: TrainConfig) -> int:
    """Samples the whole run consumes (max_steps x G without a ramp)."""
    ramp = batch_ramp(train)
    if ramp is None:
        return train.max_steps * train.global_batch_size
    return ramp.samples_before(run_steps(train))


def check_batch_ramp(train: TrainConfig, dp_size: int) -> None:
    """Refuse a ramp whose stages are not whole multiples of micro_batch_size x data-parallel size (one line each)."""
    r, g = train.batch_size_schedule, train.global_batch_size
    if r.start == 0:
        if r.increment or r.ramp_samples:
            raise ConfigError(f"{KEY}.start", "is 0 (no ramp) but increment/ramp_samples are set", "set a start > 0")
        return
    unit = train.micro_batch_size * dp_size
    if r.start >= g:
        raise ConfigError(
            f"{KEY}.start", f"{r.start} is not below train.global_batch_size ({g})", f"set a start < {g}, or 0 (off)"
        )
    if r.start % unit:
        raise ConfigError(
            f"{KEY}.start",
            f"{r.start} is not a multiple of micro_batch_size x data-parallel size = {unit}",
            f"use {_near(r.start, unit)}",
        )
    if r.increment == 0 or r.increment % unit:
        raise ConfigError(
            f"{KEY}.increment",
            f"{r.increment} is not a positive multiple of micro_batch_size x data-parallel size = {unit}",
            f"use {_near(r.increment, unit)}",
        )
    if (g - r.start) % r.increment:
        fits = [d for d in range(unit, g - r.start + 1, unit) if (g - r.start) % d == 0]
        raise ConfigError(
            f"{KEY}.increment",
            f"{r.increment} does not divide train.global_batch_size - start = {g - r.start}",
            f"use one of {', '.join(map(str, fits[:6]))}",
        )
    if r.ramp_samples == 0:
        raise ConfigError(
            f"{KEY}.ramp_samples", "is 0 with a ramp on", "set the samples the ramp spans, e.g. 1% of the run"
        )


def _near(value: int, unit: int) -> str:
    lo = max(unit, value // unit * unit)
    return f"{lo} or {lo + unit}" if lo != value else str(lo + unit)
