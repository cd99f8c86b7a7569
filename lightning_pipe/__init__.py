"""Pipeline parallelism for PyTorch Lightning, on ``torch.distributed.pipelining``.

``Trainer(strategy=PipelineStrategy(...))`` or, after ``import lightning_pipe``, ``Trainer(strategy="pipeline")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.checkpoint import stored_balance
from lightning_pipe.partition import StageLayout
from lightning_pipe.pipeline import SCHEDULE_NAMES
from lightning_pipe.strategy import PipelineStrategy

__all__ = ["PipelineStrategy", "SCHEDULE_NAMES", "StageLayout", "stored_balance"]
__version__ = "0.1.0"

# Lightning has no hook for strategies from other packages: register on import (a no-op the second time).
PipelineStrategy.register_strategies(StrategyRegistry)
