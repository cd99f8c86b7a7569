"""What every batch does with this rank's FSDP units: ``_model/shard.py`` shards them once, at setup ([Note: sharded
stages]); here they accumulate a step's gradients unsharded, reduce them after the schedule, and reshard after an
evaluation batch. The reduce-scatter in the last backward is ``_step/unit_reduce_scatter.py``'s ([Note: overlapped
reductions]).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import fields
from typing import TYPE_CHECKING, Callable

from lightning_pipe._compat.parallel import fsdp_defer_reduction, fsdp_reduce_now, fsdp_scale_unsharded_grads
from lightning_pipe._model.shard import StageSharding

if TYPE_CHECKING:
    from contextlib import AbstractContextManager


class ShardedStages(StageSharding):
    """This rank's FSDP units (:class:`~lightning_pipe._model.shard.StageSharding`, what setup made) and the calls
    the runtime makes on them for every batch."""

    @classmethod
    def of(cls, sharding: StageSharding) -> ShardedStages:
        """The units ``sharding`` holds, with their per-batch calls."""
        return cls(**{f.name: getattr(sharding, f.name) for f in fields(sharding)})

    def before_step(self) -> None:
        """Unshard the outside unit (it has no forward hooks) and let every unit accumulate this step's gradients
        unsharded."""
        if self.outside is not None:
            self.outside.unshard()
        for unit in self.units:
            fsdp_defer_reduction(unit)

    def reduce(
        self, scale: float, span: Callable[[str], AbstractContextManager[None]], skip: Collection[int] = ()
    ) -> None:
        """Scale the accumulated unsharded gradients by ``scale`` and reduce them into the sharded ``.grad``
        (``span(name)`` around each unit's reduction, for the timeline), but for the units whose ids are in ``skip``
        (reduced in the last backward already)."""
        for unit in reversed(self.units):
            if id(unit) in skip:
                continue
            if scale != 1.0:
                fsdp_scale_unsharded_grads(unit, scale)
            what = "outside modules" if unit is self.outside else type(unit).__name__.removeprefix("FSDP")
            with span(f"reduce-scatter {what}"):
                fsdp_reduce_now(unit)

    def reshard(self) -> None:
        """Free the unsharded parameters (after an evaluation batch)."""
        for unit in self.units:
            unit.reshard()
