"""Typed configuration: one schema module per Hydra group, composition, and every validity check."""
from lmforge.config.batch import BatchPlan, batch_plan
from lmforge.config.errors import ConfigError
from lmforge.config.schema import RootConfig

__all__ = ["BatchPlan", "ConfigError", "RootConfig", "batch_plan"]
