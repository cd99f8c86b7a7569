"""Sharded stages' block units reduce-scatter their gradients in their own post-backward hooks during the last
backward, as FSDP does in a plain backward, after multiplying them by the step's loss weight.

The units defer their reduction over the other microbatches (``_step/sharded.py``: ``ShardedStages.before_step``);
the units this does not reach reduce after the schedule (``ShardedStages.reduce``). When and why: [Note: overlapped
reductions] (``_step/last_backward.py``) and [Note: sharded stages] (``_model/shard.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Callable, Optional

from torch import nn

from lightning_pipe._compat.parallel import fsdp_reduce_in_backward, fsdp_sharded_params

if TYPE_CHECKING:
    from lightning_pipe.timeline import TimelineRecorder


class UnitReduceScatter:
    """The reduce-scatter of each sharded stage's block units in that stage's last backward.

    Since :meth:`start`, :attr:`reduced_units` holds the ids of the units that reduced their gradients, and
    :attr:`reduced` their sharded parameters.

    Args:
        stage_units: ``{stage: FSDP units}`` of its blocks.
    """

    def __init__(self, stage_units: dict[int, list[nn.Module]]) -> None:
        self.stage_units = stage_units
        self.reduced: set[nn.Parameter] = set()
        self.reduced_units: set[int] = set()

    def start(self) -> None:
        """Before the schedule: forget the last step's units."""
        self.reduced, self.reduced_units = set(), set()

    @contextmanager
    def reducing(
        self, stage: int, weight: Callable[[], float], recorder: Optional[TimelineRecorder] = None
    ) -> Iterator[None]:
        """Around the last full backward of ``stage``: its block units reduce-scatter in their post-backward hooks,
        their unsharded gradients multiplied by ``weight()`` first; with ``recorder``, each reduce-scatter is traced
        as a ``collective`` event. After the block, the units defer their reduction again."""
        restore: list[Callable[[], None]] = []
        for unit in self.stage_units.get(stage, []):
            restore.append(fsdp_reduce_in_backward(unit, _weighted(unit, weight, recorder)))
            self.reduced_units.add(id(unit))
            self.reduced.update(fsdp_sharded_params(unit))
        try:
            yield
        finally:
            for undo in restore:
                undo()


def _weighted(
    unit: nn.Module, weight: Callable[[], float], recorder: Optional[TimelineRecorder]
) -> Callable[[Callable[[float], None]], None]:
    """``around(reduce)`` for :func:`~lightning_pipe._compat.parallel.fsdp_reduce_in_backward`: the unit's reduction
    with the step's loss weight, traced."""
    name = type(unit).__name__.removeprefix("FSDP")

    def around(reduce: Callable[[float], None]) -> None:
        scale = weight()
        what = f"reduce-scatter {name} (in backward)"
        with recorder.collective(what) if recorder is not None else nullcontext():
            return reduce(scale)

    return around
