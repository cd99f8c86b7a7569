"""Which samples each rank loads: the sampler policy of the strategy's data loaders.

Every stage of one pipeline loads its own data and must see the same batch, so data is split over the pipeline
replicas only (:func:`sampler_kwargs`). With one replica the strategy, not Lightning, decides the loaders' samplers
(:func:`takes_over_sampling`, :func:`same_order_on_every_stage`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_pipe._compat.lightning import keep_loader_order
from lightning_pipe._lightning.seed import global_seed

if TYPE_CHECKING:
    import lightning.pytorch as pl


def sampler_kwargs(data_parallel_size: int, data_parallel_rank: int) -> dict[str, int]:
    """The arguments of the distributed sampler Lightning puts on the loaders: every stage of one pipeline must see
    the same batch, so the sampler splits over replicas only."""
    return {"num_replicas": data_parallel_size, "rank": data_parallel_rank}


def takes_over_sampling(trainer: pl.Trainer, data_parallel_size: int) -> bool:
    """With one pipeline (no data parallelism), stop Lightning from putting its shuffling distributed sampler on the
    loaders; whether it would have (then :func:`same_order_on_every_stage` decides instead)."""
    return data_parallel_size == 1 and keep_loader_order(trainer)


def same_order_on_every_stage(dataloader: object) -> object:
    """With one pipeline (no data parallelism) the loaders are left as they are, not given Lightning's shuffling
    distributed sampler: a ``shuffle=False`` loader keeps its order, as on one device. A loader that shuffles
    from the global random state (``shuffle=True`` without a ``generator``) would draw a different order on each
    stage, whose random states part ways: it gets a sampler seeded the same on every stage and reshuffled every
    epoch (``DistributedSampler(num_replicas=1, seed=<seed_everything's, else 0>)``, what DDP gives each
    replica). Any other sampler is kept; the same-data check catches one that differs between stages."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    sampler = dataloader.sampler
    if (
        type(sampler) is RandomSampler
        and sampler.generator is None
        and not sampler.replacement
        and sampler.num_samples == len(sampler.data_source)  # a DistributedSampler draws the whole dataset
    ):
        same = DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=True, seed=global_seed())
        return _update_dataloader(dataloader, same)  # as Lightning puts its own sampler in
    return dataloader


def batch_size(loader: object) -> Optional[int]:
    """The loader's ``batch_size`` (``None`` for one without, e.g. a batch sampler's)."""
    return getattr(loader, "batch_size", None)


def loaders(value: Any) -> list[Any]:
    """The loaders of a Trainer's ``*_dataloaders``: one, a sequence or a dict of them, or none."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    return [value]
