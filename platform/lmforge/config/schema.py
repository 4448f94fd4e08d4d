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
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # downstream tasks in the loop (lmforge.evaluation)
