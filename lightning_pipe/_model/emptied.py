"""Modules a cut leaves without a parameter: Hugging Face's ``dtype`` and ``device`` keep answering.

A Hugging Face model reads its own dtype and device from its parameters (``ModuleUtilsMixin.dtype``:
``next(p.dtype for p in self.parameters() ...)``), and some of its forwards do so on every call: Mllama's vision
model casts its pixels to ``self.dtype``. On a rank whose stages hold none of such a model's parameters, they are all
ghost attributes (:mod:`lightning_pipe._ghost`), ``parameters()`` is empty, and ``next`` raises ``StopIteration``.
That exception is worse than a crash: Lightning's loops take a ``StopIteration`` out of ``training_step`` for the end
of the data, so that rank alone ends its epoch silently, and the next collective of the other ranks waits forever.

[Note: emptied models] :func:`lend_ghost_dtype` gives each such model, while it is cut, a class that puts
:class:`_GhostDtype` in front of its own (same name, qualified name and module; ``isinstance`` still holds): when
the model has a parameter its answer is Hugging Face's, otherwise the dtype and device of its ghosts, which are the
ones the parameters have on the rank that holds them. :func:`restore_classes` puts the model's own class back when
the module is whole again.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from lightning_pipe._ghost import Ghost

#: One variant class per model class.
_variants: dict[type, type] = {}


def _ghosts(module: nn.Module) -> Iterator[Ghost]:
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, Ghost):
                yield value


class _GhostDtype:
    """Hugging Face's ``dtype`` and ``device`` for a model whose parameters may all be ghosts on this rank."""

    @property
    def dtype(self) -> torch.dtype:
        for p in self.parameters():  # type: ignore[attr-defined]
            if p.is_floating_point():
                return super().dtype  # type: ignore[misc]
        for ghost in _ghosts(self):  # type: ignore[arg-type]
            if ghost.is_floating_point():
                return ghost.dtype
        return super().dtype  # type: ignore[misc]

    @property
    def device(self) -> torch.device:
        for _ in self.parameters():  # type: ignore[attr-defined]
            return super().device  # type: ignore[misc]
        for ghost in _ghosts(self):  # type: ignore[arg-type]
            return ghost.device
        return super().device  # type: ignore[misc]


def _reads_own_parameters(cls: type) -> bool:
    """Whether ``cls`` answers ``dtype`` and ``device`` from its parameters, as ``transformers``' models do."""
    return any(
        klass.__name__ == "ModuleUtilsMixin" and klass.__module__.startswith("transformers.") for klass in cls.__mro__
    )


def lend_ghost_dtype(module: nn.Module) -> list[tuple[nn.Module, type]]:
    """Give every Hugging Face model inside ``module`` (cut: some parameters are ghosts) that holds no parameter on
    this rank the ghost-aware ``dtype``/``device`` (see [Note: emptied models]); returns ``(model, its own class)``
    for :func:`restore_classes`."""
    lent = []
    for sub in module.modules():
        cls = type(sub)
        if cls in _variants.values() or not _reads_own_parameters(cls):
            continue
        if any(True for _ in sub.parameters()) or not any(True for _ in _ghosts(sub)):
            continue
        variant = _variants.get(cls)
        if variant is None:
            variant = type(cls.__name__, (_GhostDtype, cls), {"__qualname__": cls.__qualname__})
            variant.__module__ = cls.__module__
            _variants[cls] = variant
        sub.__class__ = variant
        lent.append((sub, cls))
    return lent


def restore_classes(lent: list[tuple[nn.Module, type]]) -> None:
    """Put back the classes :func:`lend_ghost_dtype` replaced."""
    for sub, cls in lent:
        sub.__class__ = cls
    lent.clear()
