"""Throughput and MFU for one training step.

MFU = achieved model FLOP/s per device / peak FLOP/s per device, where model FLOP/s =
tokens/s per device * ``lmforge.model.flops.flops_per_token`` (recompute from activation checkpointing is
not counted) and the peak comes from ``lmforge.runtime.hardware.peak_tflops``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTiming:
    step_time_s: float
    data_wait_s: float
    tokens: int  # tokens processed by the whole job in this step


@dataclass
class ThroughputMeter:
    flops_per_token: int
    peak_tflops_per_device: float
    world_size: int

    def measure(self, timing: StepTiming) -> dict:
        tps = timing.tokens / max(timing.step_time_s, 1e-9)
        tps_dev = tps / self.world_size
        tflops_dev = tps_dev * self.flops_per_token / 1e12
        return {
            "step_time_s": timing.step_time_s,
            "data_wait_s": timing.data_wait_s,
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps_dev,
            "tflops_per_device": tflops_dev,
            "mfu": tflops_dev / self.peak_tflops_per_device if self.peak_tflops_per_device > 0 else 0.0,
        }
