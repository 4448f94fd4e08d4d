"""The root config schema (``RootConfig``).

Each config group has its dataclass in its own module of this package (``config/model.py`` for
``conf/model/``, ...); this module only assembles them. It imports no Hydra: engines and benchmarks build a
``RootConfig`` by plain construction on machines that only have torch (benchmarks/gpu_check.py). The schema
is registered in Hydra's ConfigStore as ``lmforge_schema`` where composition happens (``config/compose.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmforge.config.checkpoint import CheckpointConfig
from lmforge.config.cluster import ClusterConfig
from lmforge.config.comm import CommConfig
from lmforge.config.data import DataConfig
from lmforge.config.eval import EvalConfig
from lmforge.config.fault import FaultConfig
from lmforge.config.logging import LoggingConfig, MetricsConfig
from lmforge.config.model import ModelConfig
from lmforge.config.optim import OptimConfig
from lmforge.config.parallelism import ParallelismConfig
from lmforge.config.run import RunConfig
from lmforge.config.train import TrainConfig


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The GPT's shape (config group ``model``)."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """Engine and layout (config group ``parallelism``)."""
    comm: CommConfig = field(default_factory=CommConfig)
    """Collectives backend and transport (config group ``comm``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Sources, tokenizer and loader (config group ``data``)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule (config group ``optim``)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The loop, batch and precision (config group ``train``)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When and how checkpoints are written and kept (config group ``checkpoint``)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console, JSONL and W&B sinks (config group ``logging``)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Overlap profiling and straggler detection (no group: set the keys directly)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The hardware a run is planned and submitted for (config group ``cluster``)."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Watchdog, loss guard, restarts and drills (config group ``fault``)."""
    run: RunConfig = field(default_factory=RunConfig)
    """Where the run lives (no group: set the keys directly)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Downstream tasks in the loop, lmforge.evaluation (no group: set the keys directly)."""
