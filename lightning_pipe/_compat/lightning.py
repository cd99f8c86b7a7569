"""Lightning's private names the package needs where it does more than read them (see :mod:`lightning_pipe._compat`).

The one-line uses (a private helper called, an attribute read) are at their callers; ``PRIVATE_NAMES`` lists them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Optional

import torch

from lightning_pipe._compat.torch import destroy_process_groups_at_exit

if TYPE_CHECKING:
    from collections.abc import Iterable
    from datetime import timedelta

    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.callbacks import Callback, WeightAveraging
    from torch.optim.swa_utils import AveragedModel


def init_process_group(
    cluster_environment: ClusterEnvironment, backend: str, timeout: Optional[timedelta], device: torch.device
) -> None:
    """Start the default process group the way Lightning's DDP strategy does, and have every process group
    destroyed when the interpreter exits (:func:`~lightning_pipe._compat.torch.destroy_process_groups_at_exit`)."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    device_id = device if device.type != "cpu" else None
    _init_dist_connection(cluster_environment, backend, timeout=timeout, device_id=device_id)
    destroy_process_groups_at_exit()


def count_replicas_in_throughput(callbacks: Iterable[Callback], replicas: int) -> None:
    """Make every ``ThroughputMonitor`` scale its per-process figures by the number of pipeline replicas."""
    from lightning.pytorch.callbacks import ThroughputMonitor

    for callback in callbacks:
        if isinstance(callback, ThroughputMonitor):
            for throughput in callback._throughputs.values():
                throughput.world_size = replicas


def averaged_model_like(callback: WeightAveraging, module: torch.nn.Module, device: torch.device) -> AveragedModel:
    """The ``AveragedModel`` a ``WeightAveraging`` callback's ``setup`` builds, of ``module``."""
    from torch.optim.swa_utils import AveragedModel

    return AveragedModel(model=module, device=device, use_buffers=callback._use_buffers, **callback._kwargs)


def keep_loader_order(trainer: pl.Trainer) -> bool:
    """Stop Lightning from putting its distributed sampler on the loaders; whether it would have."""
    connector = trainer._accelerator_connector
    would = bool(connector.use_distributed_sampler)
    connector.use_distributed_sampler = False
    return would


@contextmanager
def logging_routed_to(module: pl.LightningModule, log: Callable[..., None]) -> Iterator[None]:
    """Route ``module.log`` (and so ``module.log_dict``) to ``log`` for the duration of the block (an instance
    attribute, set in the module's ``__dict__`` directly: ``nn.Module.__setattr__`` would look through its parameters,
    buffers and submodules first, on every stage run)."""
    vars(module)["log"] = log
    try:
        yield
    finally:
        vars(module).pop("log", None)
