"""The run's seed as Lightning's ``seed_everything`` set it."""

from __future__ import annotations

import os


def global_seed() -> int:
    """``seed_everything``'s seed (``PL_GLOBAL_SEED``), else 0: the one place it is read. It seeds meta-device
    initialisation (:func:`materialize_local`) and the sampler a single pipeline gives a shuffling loader."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
