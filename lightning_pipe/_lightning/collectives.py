"""Lightning's strategy collectives (``barrier``, ``broadcast``, ``reduce``) over every process, each wait watched by
the stall reporter (:mod:`lightning_pipe._watchdog`)."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor

from lightning_pipe import _watchdog


class WatchedCollectives:
    """The collectives a Lightning strategy offers, for a strategy with a ``root_device``."""

    root_device: torch.device

    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        with _watchdog.waiting(lambda: f"every rank to reach the barrier {name or ''}".rstrip()):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        with _watchdog.waiting(lambda: f"a broadcast from rank {src} (Lightning's `strategy.broadcast`)"):
            dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
        reduce_op: Optional[Union[ReduceOp, str]] = "mean",
    ) -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
