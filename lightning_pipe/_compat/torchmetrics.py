"""torchmetrics' private names the package needs where it does more than read them.

See :mod:`lightning_pipe._compat`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchmetrics import Metric


def compute_without_sync(metric: Metric) -> Any:
    """``compute()`` on the metric's current state, without syncing across processes, as ``Metric.forward`` does."""
    metric._to_sync, metric._should_unsync, metric._computed = False, False, None
    on_cpu, metric.compute_on_cpu = metric.compute_on_cpu, False
    try:
        return metric.compute()
    finally:
        metric._to_sync, metric._should_unsync, metric._computed = metric.sync_on_compute, True, None
        metric.compute_on_cpu = on_cpu
