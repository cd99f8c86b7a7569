"""Pipeline parallelism for PyTorch Lightning, on ``torch.distributed.pipelining``.

``Trainer(strategy=PipelineStrategy(...))`` or, after ``import lightning_pipe``, ``Trainer(strategy="pipeline")``.
Importing the package registers the strategy names with Lightning and changes nothing else.

The public surface: :class:`PipelineStrategy`; :mod:`lightning_pipe.schedules` (the schedules by name),
:mod:`lightning_pipe.partition` (stage layouts), :mod:`lightning_pipe.checkpoint` (loading and consolidating
checkpoint directories; ``python -m lightning_pipe.consolidate``), :mod:`lightning_pipe.plan` (the planner;
``python -m lightning_pipe.plan``) and :mod:`lightning_pipe.timeline` (tracing one step). Modules whose names start
with an underscore are internal.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe._errors import BackboneCallError
from lightning_pipe._model.materialize import materialize
from lightning_pipe._model.pretrained import read_pretrained
from lightning_pipe._model.whole import SplitModuleError
from lightning_pipe.callbacks import HuggingFaceCheckpoint
from lightning_pipe.checkpoint import load_from_checkpoint, stored_balance
from lightning_pipe.partition import StageLayout
from lightning_pipe.schedules import SCHEDULE_NAMES
from lightning_pipe.strategy import PipelineStrategy

__all__ = [
    "BackboneCallError",
    "HuggingFaceCheckpoint",
    "PipelineStrategy",
    "SCHEDULE_NAMES",
    "SplitModuleError",
    "StageLayout",
    "load_from_checkpoint",
    "materialize",
    "read_pretrained",
    "stored_balance",
]
__version__ = "0.2.0"

# Lightning has no hook for strategies from other packages: register on import (a no-op the second time).
PipelineStrategy.register_strategies(StrategyRegistry)
