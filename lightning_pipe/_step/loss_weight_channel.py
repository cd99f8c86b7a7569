"""The step's loss weight, sent from the last stage to the pipeline's other ranks while the schedule runs.

The weight ([Note: token-weighted losses]) multiplies the gradients reduced in the last backward, and the last stage
knows it once its last microbatch's loss ran. Why on a group of its own, and why waiting for it costs nothing:
[Note: overlapped reductions] (``_step/last_backward.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


class LossWeightChannel:
    """One rank's end of the loss weight's transfer: the last stage sends it, the others receive it.

    Args:
        group: a group over this rank's pipeline that carries nothing else (``None`` with one rank: the weight stays
            where it is computed).
        last_rank: the pipeline rank of the last stage in ``group``.
        device: where the weight is received.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], last_rank: int, device: torch.device) -> None:
        self.group = group
        self.last_rank = last_rank
        self.device = device
        self._weight: Optional[float] = None
        self._box: Optional[Tensor] = None
        self._receive: Optional[dist.Work] = None
        self._sends: list[Optional[dist.Work]] = []

    def expect(self, is_last: bool) -> None:
        """Before the schedule: forget the last step's weight and, on a rank without the last stage, post the receive
        of this step's."""
        self._weight, self._sends, self._receive = None, [], None
        if self.group is not None and not is_last:
            self._box = torch.zeros((), dtype=torch.float64, device=self.device)
            self._receive = dist.irecv(self._box, group_src=self.last_rank, group=self.group)

    def share(self, weight: float) -> None:
        """On the last stage, once its last microbatch's loss ran: keep the weight and send it to the others."""
        self._weight = weight
        if self.group is None:
            return
        box = torch.tensor(weight, dtype=torch.float64, device=self.device)
        me = dist.get_rank(self.group)
        for rank in range(dist.get_world_size(self.group)):
            if rank != me:
                self._sends.append(dist.isend(box, group_dst=rank, group=self.group))

    def weight(self) -> float:
        """The step's loss weight, waiting for it on the ranks without the last stage."""
        if self._weight is None:
            assert self._receive is not None, "the loss weight was neither computed here nor received"
            self._receive.wait()
            assert self._box is not None
            self._weight = float(self._box)
        return self._weight

    def settle(self) -> None:
        """After the schedule: every step takes its own weight, also on a stage that had nothing to reduce in its
        backward, and every send has completed; no transfer is left pending."""
        if self._receive is not None:
            self.weight()
        for work in self._sends:
            work.wait()
        self._sends = []
