"""Throughput is measured over the logging interval, not from one step's host time.

A device-like worker thread runs each step's work late (the host queues up to one step ahead, as with CUDA
launches and the lagged votes): one step's host time on the logging step covers two steps of device work, so
the old per-step figure is about half the true throughput; the interval figure matches it.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from lmforge.metrics.meter import IntervalMeter

STEP_S = 0.04  # device time of one step
TOKENS = 1000  # tokens per step
EVERY = 8  # logging interval


class LaggingDevice:
    """Runs queued steps in order on a thread; ``submit`` returns at once unless one step already waits."""

    def __init__(self, step_s: float):
        self.queue: "queue.Queue[object]" = queue.Queue(maxsize=1)
        self.step_s = step_s
        self.done = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.queue.get()
            time.sleep(self.step_s)
            self.done += 1
            self.queue.task_done()

    def submit(self) -> None:
        self.queue.put(object())

    def synchronize(self) -> None:
        self.queue.join()


def run_loop(meter: IntervalMeter, device: LaggingDevice, steps: int, eval_at=(), eval_s: float = 0.0):
    old, new = [], []
    meter.start()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        device.submit()  # the step's kernels are queued; the host goes on
        meter.step_done(0.0)
        if step % EVERY == 0:
            record = meter.measure()  # synchronises the device
            old.append(TOKENS / (time.perf_counter() - t0))  # the old way: this step's host time
            new.append(record)
        if step in eval_at:
            with meter.excluded():
                time.sleep(eval_s)
    return old, new


@pytest.mark.timeout(60)
def test_interval_throughput_matches_a_lagging_device_and_one_step_host_time_does_not():
    device = LaggingDevice(STEP_S)
    meter = IntervalMeter(
        flops_per_token=6,
        peak_tflops_per_device=1.0,
        world_size=2,
        tokens_per_step=TOKENS,
        synchronize=device.synchronize,
    )
    old, new = run_loop(meter, device, 3 * EVERY)
    truth = TOKENS / STEP_S
    assert device.done == 3 * EVERY
    for record in new:
        assert record["interval_steps"] == EVERY
        assert 0.8 * truth <= record["tokens_per_s"] <= truth * 1.001, (record, truth)
        assert record["step_time_s"] == pytest.approx(record["interval_s"] / EVERY)
        assert record["tokens_per_s_per_device"] == record["tokens_per_s"] / 2
        assert record["mfu"] == pytest.approx(record["tflops_per_device"] / 1.0)
    # Negative control: the logging step's own host time waited for the step queued before it as well.
    for value in old:
        assert value < 0.65 * truth, (old, truth)


@pytest.mark.timeout(60)
def test_excluded_time_is_not_counted_and_queued_steps_are():
    device = LaggingDevice(STEP_S)
    meter = IntervalMeter(
        flops_per_token=6,
        peak_tflops_per_device=1.0,
        world_size=1,
        tokens_per_step=TOKENS,
        synchronize=device.synchronize,
    )
    _, new = run_loop(meter, device, 2 * EVERY, eval_at=(3, EVERY + 3), eval_s=0.3)
    truth = TOKENS / STEP_S
    # excluded() drains the queue first: the steps queued before it stay in the interval, the 0.3 s does not.
    for record in new:
        assert 0.8 * truth <= record["tokens_per_s"] <= truth * 1.001, (record, truth)
    # Without the exclusion the same loop would have reported far less.
    plain = IntervalMeter(6, 1.0, 1, TOKENS, synchronize=device.synchronize)
    plain.start()
    for _ in range(EVERY):
        device.submit()
        plain.step_done()
    time.sleep(0.3)
    assert plain.measure()["tokens_per_s"] < 0.6 * truth


def test_an_interval_above_the_peak_refreshes_it_once_and_the_cache_keeps_the_higher_figure(tmp_path):
    """MFU above 100% means the cached CPU peak was measured while other work held the cores: it is measured again
    (announced), once, and the cache keeps the higher figure; below the peak nothing is re-measured (control)."""
    import torch

    from lmforge.runtime import hardware

    clock = iter(float(t) for t in range(100))
    calls = []

    def refresh(achieved, peak):
        calls.append((achieved, peak))
        return 2 * achieved

    meter = IntervalMeter(
        flops_per_token=10**6,
        peak_tflops_per_device=1e-6,
        world_size=1,
        tokens_per_step=TOKENS,
        clock=lambda: next(clock),
        refresh_peak=refresh,
    )
    meter.start()  # t=0
    meter.step_done()
    first = meter.measure()  # t=1: 1000 tokens/s * 1e6 FLOPs = 1e-3 TFLOP/s, above the 1e-6 peak
    assert calls == [(pytest.approx(1e-3), 1e-6)] and first["mfu"] == pytest.approx(1e-3 / 2e-3)
    meter.step_done()
    meter.measure()
    assert len(calls) == 1, "refreshed once per run"
    quiet = IntervalMeter(10**6, 1.0, 1, TOKENS, clock=lambda: next(clock), refresh_peak=refresh)
    quiet.start()
    quiet.step_done()
    assert quiet.measure()["mfu"] < 1 and len(calls) == 1  # control: below the peak, nothing is re-measured

    cache, lines = tmp_path / "cpu_peak.json", []
    low = hardware.cpu_peak_tflops(torch.float32, cache=cache)
    new = hardware.refresh_cpu_peak(torch.float32, achieved=10 * low, peak=low / 100, warn=lines.append, cache=cache)
    assert low / 100 < new == hardware.cpu_peak_tflops(torch.float32, cache=cache)
    assert len(lines) == 1 and lines[0].startswith("lmforge: warning: the step ran at ") and str(cache) in lines[0]
