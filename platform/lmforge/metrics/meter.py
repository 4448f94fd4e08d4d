"""Throughput and MFU over the logging interval.

The host runs ahead of the device (CUDA launches are asynchronous; the lagged votes and the loss guard read
device values a step late), so one step's host time says nothing about the device: a step whose launches
return at once looks infinitely fast, and the logging step, which waits for everything queued before it,
looks slow. :class:`IntervalMeter` therefore measures between logging steps only:

    tokens_per_s = tokens consumed since the last logging step / wall time since it

with the device synchronised at both ends (``synchronize``; a no-op on CPU), so the interval holds exactly
the work of its steps. ``step_time_s`` is the interval time / its steps, ``data_wait_s`` the mean time the
loop waited for batches. Time excluded with :meth:`IntervalMeter.excluded` (evaluation) is not counted.

MFU = achieved model FLOP/s per device / peak FLOP/s per device, where model FLOP/s =
tokens/s per device * ``lmforge.model.flops.flops_per_token`` (recompute from activation checkpointing is
not counted) and the peak comes from ``lmforge.runtime.hardware.peak_tflops``. A step may report its own
FLOPs per token (document masking: attention within documents only, ``document_flops_per_token`` of this
rank's batches); the interval then uses the mean of the steps' values.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional


def _no_sync() -> None:
    return None


@dataclass
class IntervalMeter:
    flops_per_token: int
    peak_tflops_per_device: float
    world_size: int
    tokens_per_step: int
    synchronize: Callable[[], None] = _no_sync  # waits for the device's queued work (torch.cuda.synchronize)
    clock: Callable[[], float] = time.perf_counter
    # (achieved, peak) -> a new peak, called once when an interval beats the peak (runtime.hardware.refresh_cpu_peak)
    refresh_peak: Optional[Callable[[float, float], float]] = None
    _mark: Optional[float] = field(default=None, init=False)
    _steps: int = field(default=0, init=False)
    _data_wait: float = field(default=0.0, init=False)
    _excluded: float = field(default=0.0, init=False)
    _step_flops: list = field(default_factory=list, init=False)  # (FLOPs per token, tokens) per step, when reported
    _profiled: int = field(default=0, init=False)  # steps left out of the interval (profiled: ``excluded``)
    _tokens: int = field(default=0, init=False)  # tokens of the interval's steps (a batch ramp varies them)

    def start(self) -> None:
        """Open the first interval (before the first step of this launch)."""
        self.synchronize()
        self._mark = self.clock()
        self._steps, self._data_wait, self._excluded, self._tokens = 0, 0.0, 0.0, 0

    def step_done(
        self, data_wait_s: float = 0.0, flops_per_token: Optional[float] = None, tokens: Optional[int] = None
    ) -> None:
        """One optimizer step was issued (no device sync); ``flops_per_token``: this step's own, if it differs;
        ``tokens``: the step's tokens over all ranks (a batch ramp's), None = ``tokens_per_step``."""
        if self._mark is None:
            self.start()
        self._steps += 1
        self._data_wait += data_wait_s
        step_tokens = self.tokens_per_step if tokens is None else tokens
        self._tokens += step_tokens
        if flops_per_token is not None:
            self._step_flops.append((flops_per_token, step_tokens))

    def step_left_out(self) -> None:
        """A step that ran inside ``excluded()`` (the overlap probe's profiled step): neither its time nor its tokens
        count; the interval's record says how many (``profiled_steps``)."""
        if self._mark is None:
            self.start()
        self._profiled += 1

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time that is not training (evaluation): the device is drained first, so queued steps stay counted."""
        self.synchronize()
        t0 = self.clock()
        try:
            yield
        finally:
            self.synchronize()
            self._excluded += self.clock() - t0

    def measure(self) -> dict:
        """Close the interval (synchronising the device) and return its throughput; the next one starts now."""
        self.synchronize()
        now = self.clock()
        if self._mark is None or self._steps == 0:
            self._mark = now
            return {}
        seconds = max(now - self._mark - self._excluded, 1e-9)
        steps = self._steps
        tokens = self._tokens
        tps = tokens / seconds
        tps_dev = tps / self.world_size
        per_token = (  # the steps' own FLOPs per token, weighted by their tokens
            sum(f * t for f, t in self._step_flops) / sum(t for _, t in self._step_flops)
            if self._step_flops
            else self.flops_per_token
        )
        tflops_dev = tps_dev * per_token / 1e12
        if self.refresh_peak is not None and tflops_dev > self.peak_tflops_per_device > 0:
            # MFU above 100%: the peak was measured under contention (CPU); measured again, once, announced
            self.peak_tflops_per_device = self.refresh_peak(tflops_dev, self.peak_tflops_per_device)
            self.refresh_peak = None
            now = self.clock()  # the measurement is not the next interval's training time
        record = {
            **({"profiled_steps": self._profiled} if self._profiled else {}),
            "step_time_s": seconds / steps,
            "data_wait_s": self._data_wait / steps,
            "interval_steps": steps,
            "interval_s": seconds,
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps_dev,
            "tflops_per_device": tflops_dev,
            "mfu": tflops_dev / self.peak_tflops_per_device if self.peak_tflops_per_device > 0 else 0.0,
        }
        self._mark, self._steps, self._data_wait, self._excluded, self._profiled = now, 0, 0.0, 0.0, 0
        self._step_flops, self._tokens = [], 0
        return record


def device_synchronizer(device) -> Callable[[], None]:
    """``torch.cuda.synchronize(device)`` on a GPU, nothing on the CPU (its work is done when the call returns)."""
    if getattr(device, "type", "cpu") != "cuda":
        return _no_sync
    import torch

    return lambda: torch.cuda.synchronize(device)
