"""Per-rank state dicts inside Lightning's checkpoint dict, stored in the distributed checkpoint.

Some callbacks put a copy of the module's state into the checkpoint (SWA's averaged model, ``WeightAveraging``'s
``current_model_state``). Under the pipeline each rank's copy holds its own tensors, but only rank 0 writes
``meta.pt``. Such a dict is replaced by a *marker* ``{MARK: key}`` and its tensors are stored in the distributed
checkpoint as ``<key>.<stored name>``, like the weights; loading replaces each marker by this rank's tensors, and
consolidation by the whole model's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

MARK = "lightning_pipe.stored_as"


def marker(key: str) -> dict[str, str]:
    return {MARK: key}


def markers(tree: Any) -> Iterator[tuple[dict, Any, str]]:
    """``(container, key in container, stored key)`` of every marker in the nested dicts of ``tree``."""
    if not isinstance(tree, dict):
        return
    for key, value in list(tree.items()):
        if isinstance(value, dict) and set(value) == {MARK}:
            yield tree, key, value[MARK]
        else:
            yield from markers(value)
