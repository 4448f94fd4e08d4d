"""Typed configuration: one schema module per Hydra group, composition, and every validity check.

This package's ``__init__`` imports nothing that needs Hydra, so the model and its FLOPs formula import on
machines that only have torch (the GPU check in benchmarks/gpu_check.py relies on it).
"""

from lmforge.config.batch import BatchPlan, batch_plan
from lmforge.config.errors import ConfigError

__all__ = ["BatchPlan", "ConfigError", "batch_plan"]
