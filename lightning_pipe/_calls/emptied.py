"""Modules a cut leaves without a parameter: ``dtype``, ``device`` and, while a step runs, ``parameters()`` keep
answering.

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
the module is whole again. Diffusers' models (``ModelMixin``: ``get_parameter_dtype(self)``, whose last resort
fails with ``UnboundLocalError`` on a module without a tensor) get the same.

Models also read a submodule's parameters directly, in code that runs before the backbone on every stage: Wan's
``next(iter(self.time_embedder.parameters())).dtype``, SkyReels-V2's ``get_parameter_dtype(self.time_embedder)``.
While a step runs (:func:`ghost_parameters`, entered by every run of the step), each module that holds no parameter
on this rank but stands for some answers ``parameters()`` and ``named_parameters()`` with their ghosts, as the rank
that holds them answers with the parameters: an instance attribute for the run only, so outside the step (the
optimizer, callbacks, clipping, checkpoints) a module still has exactly the parameters this rank holds. The
backbone's blocks do not count: runners stand in for them while the step runs, so the last stage's GPT-1 model,
which holds blocks but not the embeddings, has no parameter then (``next(self.parameters())`` in its forward).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Callable

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


_READERS = (("ModuleUtilsMixin", "transformers."), ("ModelMixin", "diffusers."))


def _reads_own_parameters(cls: type) -> bool:
    """Whether ``cls`` answers ``dtype`` and ``device`` from its parameters, as ``transformers``' and ``diffusers``'
    models do."""
    return any(
        klass.__name__ == name and klass.__module__.startswith(package)
        for klass in cls.__mro__ for name, package in _READERS
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


#: The whole module -> the modules that answer ``parameters()`` with ghosts while its step runs.
_step_stand_ins: weakref.WeakKeyDictionary[nn.Module, list[tuple[nn.Module, dict[int, list[str]]]]] = (
    weakref.WeakKeyDictionary()
)


def lend_ghost_parameters(
    module: nn.Module, ghost_parameters: Sequence[tuple[nn.Module, str]], blocks: Sequence[nn.Module] = ()
) -> None:
    """Note, for :func:`ghost_parameters`, the modules of ``module`` (cut) that hold no parameter on this rank while
    its step runs and stand for some: ``ghost_parameters`` are the ``(owner, name)`` of the parameters that became
    ghost attributes; ``blocks``, the backbone's blocks, which runners stand in for while the step runs.

    A model whose blocks this rank holds but whose parameters outside them live on another stage (the last stage of
    GPT-1 and ProphetNet, whose embeddings are the first stage's) has no parameter while the step runs either: its
    blocks are not registered under it then. Its ``next(self.parameters())`` must find the ghosts."""
    names: dict[int, list[str]] = {}
    for owner, name in ghost_parameters:
        names.setdefault(id(owner), []).append(name)
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    block_params = {id(p) for block in blocks for p in block.parameters()}
    emptied = []
    for sub in module.modules():
        inside = id(sub) in in_blocks  # a block's own modules keep their parameters while it runs
        stands = {id(m): names[id(m)] for m in sub.modules() if id(m) in names and (inside or id(m) not in in_blocks)}
        if not stands or any(True for p in sub.parameters() if inside or id(p) not in block_params):
            continue
        emptied.append((sub, stands))
    _step_stand_ins[module] = emptied


def forget_ghost_parameters(module: nn.Module) -> None:
    """The module is whole again: no module stands in for parameters any more."""
    _step_stand_ins.pop(module, None)


def ghost_parameters(module: nn.Module) -> AbstractContextManager[None]:
    """While the step of ``module`` runs: the modules :func:`lend_ghost_parameters` noted answer ``parameters()`` and
    ``named_parameters()`` with their ghosts ([Note: emptied models])."""
    emptied = _step_stand_ins.get(module)
    return _ghosts_lent(emptied) if emptied else nullcontext()  # nothing to lend: no generator per stage run


@contextmanager
def _ghosts_lent(emptied: list[tuple[nn.Module, dict[int, list[str]]]]) -> Iterator[None]:
    for sub, names in emptied:
        # Bound methods, as the class's are: dynamo reads ``module.named_parameters.__func__`` when it traces a
        # compiled model through an emptied module.
        named = types.MethodType(_named_ghosts(names), sub)
        vars(sub)["named_parameters"] = named
        vars(sub)["parameters"] = types.MethodType(_ghosts_only(named), sub)
    try:
        yield
    finally:
        for sub, _ in emptied:
            vars(sub).pop("named_parameters", None)
            vars(sub).pop("parameters", None)


def _named_ghosts(names: dict[int, list[str]]) -> Callable[..., Iterator[tuple[str, Ghost]]]:
    def named_parameters(
        module: nn.Module, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Ghost]]:
        subs = module.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, module)]
        seen: set[int] = set()
        for path, sub in subs:
            for name in names.get(id(sub), ()):
                ghost = vars(sub).get(name)
                if not isinstance(ghost, Ghost) or (remove_duplicate and id(ghost) in seen):
                    continue
                seen.add(id(ghost))
                yield (f"{path}.{name}" if path else name), ghost

    return named_parameters


def _ghosts_only(named: Callable[..., Iterator[tuple[str, Ghost]]]) -> Callable[..., Iterator[Ghost]]:
    def parameters(module: nn.Module, recurse: bool = True) -> Iterator[Ghost]:
        for _, ghost in named(recurse=recurse):
            yield ghost

    return parameters
