"""Finding the backbone: the blocks a pipeline cuts into stages.

The backbone is one container of blocks, or several consecutive ones: an ``nn.Sequential`` the user's code calls
as a whole (``self.blocks(x)``), or an ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict`` it loops over
(``for block in self.layers: x = block(x, mask)``), or a list of them run one after the other (torchvision's
``layer1`` ... ``layer4``). Its blocks, in order, are what the stages split; everything else in the module runs
before the backbone (first stage) or after it (last stage). See :mod:`lightning_pipe._model.structure` for how the step
uses them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import Optional, Union

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_pipe._calls.blocks import Backbone, Block

log = logging.getLogger(__name__)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
_CONTAINER_NAMES = "an `nn.Sequential`, `nn.ModuleList` or `nn.ModuleDict`"


def find_backbone(
    module: nn.Module, spec: Union[str, Sequence[str]] = "auto", runs: Optional[Collection[str]] = None,
    recorded: Collection[str] = (),
) -> Backbone:
    """The backbone of ``module``: the container(s) at the dotted path(s) ``spec``, or found (``"auto"``).

    ``"auto"`` takes a ``backbone`` attribute if the module has one, else a container of blocks (outermost first;
    see :func:`_repeated_containers`): the longest, unless it leaves most of the module's parameters outside while
    another holds more (then the one that holds the most); it refuses, listing the candidates, when that leaves a
    tie. It logs its choice. (Before that, ``_model/split.py`` tries every candidate together, kept when the step
    runs them one after the other: :func:`consecutive_candidates`.) ``runs``: the candidates the step runs, where
    ``_model/split.py`` found out; auto chooses among those only (a vision-language model's vision layers are no
    candidate for a step on text-only rows). ``recorded``: candidates whose blocks' own outputs the step records
    (Hugging Face's hidden states), which auto leaves out too.
    """
    if isinstance(spec, str) and spec == "auto":
        paths = _auto_paths(module, runs, recorded)
    else:
        paths = [spec] if isinstance(spec, str) else list(spec)
        if not paths:
            raise ValueError("`PipelineStrategy(backbone=[])` names no container; name at least one, or use 'auto'.")
    containers = [_resolve(module, path, spec) for path in paths]
    for i, a in enumerate(containers):
        for j, b in enumerate(containers):
            if i != j and (a is b or any(m is b for m in a.modules())):
                raise ValueError(
                    f"`PipelineStrategy(backbone={list(paths)})`: `{paths[j]}` is inside `{paths[i]}` (or the same"
                    " container). List consecutive containers that do not contain each other."
                )
    blocks = []
    for c, (path, container) in enumerate(zip(paths, containers)):
        if len(container) == 0:
            raise ValueError(f"`PipelineStrategy`: the backbone container `{path}` is empty; name one with blocks.")
        for key in container._modules:
            blocks.append(Block(len(blocks), c, key, f"{path}.{key}"))
    backbone = Backbone(tuple(paths), tuple(containers), tuple(blocks))
    log.debug("backbone: %s", backbone.describe())
    return backbone


def consecutive_candidates(module: nn.Module) -> Optional[list[str]]:
    """For ``backbone="auto"`` without a ``backbone`` attribute: the paths of every container of repeated blocks, in
    module order, when there are several (an encoder's then a decoder's layers, torchvision's ``layer1`` ..
    ``layer4``); ``None`` otherwise. The caller keeps them only if the step runs them one after the other."""
    if isinstance(getattr(module, "backbone", None), _CONTAINERS):
        return None
    candidates = _repeated_containers(module)
    return [name for name, _ in candidates] if len(candidates) > 1 else None


def _auto_paths(module: nn.Module, runs: Optional[Collection[str]] = None, recorded: Collection[str] = ()) -> list[str]:
    own = getattr(module, "backbone", None)
    if isinstance(own, _CONTAINERS):
        return ["backbone"]
    candidates = _repeated_containers(module)
    idle = [name for name, _ in candidates if runs is not None and name not in runs]
    records = [name for name in recorded if name not in idle]
    if len(idle) + len(records) == len(candidates):  # none is left: the refusal names the one chosen
        idle, records = [], []
    candidates = [(name, c) for name, c in candidates if name not in idle and name not in records]
    if not candidates:
        found = [n for n, m in module.named_modules() if n and isinstance(m, _CONTAINERS)]
        hint = f" Containers found: {found[:8]}." if found else " The module has no nn.Sequential or nn.ModuleList."
        raise ValueError(
            f"`PipelineStrategy(backbone='auto')` found no container of repeated blocks in `{type(module).__name__}`."
            " Set `backbone=` to the dotted path of the container that holds the blocks (e.g. 'model.layers' or"
            f" 'transformer.h'), or a list of consecutive containers.{hint}"
        )
    name, container = _choose(module, candidates)
    unused = f" (the step does not run {', '.join(f'`{n}`' for n in idle)})" if idle else ""
    if records:
        unused += (f" (not {', '.join(f'`{n}`' for n in records)}: the step records its blocks' outputs, Hugging Face's"
                   " hidden states, which a stage that skips them cannot)")
    rank_zero_info(
        f"PipelineStrategy: pipelining `{name}` ({_describe(container)}), which holds {_share(module, container)} of"
        f" the parameters{unused}; set `backbone=` to choose another."
    )
    return [name]


def _choose(module: nn.Module, candidates: list[tuple[str, nn.Module]]) -> tuple[str, nn.Module]:
    """The longest candidate; but one that leaves most parameters outside the pipeline gives way to the candidate
    that holds the most (Mllama: 2 vision layers against 4 language layers of two classes, or 8 small vision layers
    against 4 large language layers). Refuses on a tie."""
    longest = max(len(c) for _, c in candidates)
    best = [(n, c) for n, c in candidates if len(c) == longest]
    total = _numel(module)
    if len(best) > 1 or 2 * _numel(best[0][1]) < total:
        heaviest = max(_numel(c) for _, c in candidates)
        heavy = [(n, c) for n, c in candidates if _numel(c) == heaviest]
        if len(heavy) == 1 and (len(best) > 1 or heaviest > _numel(best[0][1])):
            best = heavy
    if len(best) > 1:
        listed = ", ".join(f"'{n}' ({_describe(c)})" for n, c in candidates)
        shares = ", ".join(_share(module, c) for _, c in candidates)
        raise ValueError(
            f"`PipelineStrategy(backbone='auto')` cannot choose: {len(best)} containers of blocks are equally long"
            f" and hold as many parameters. Candidates: {listed}, holding {shares} of the parameters. Set"
            " `backbone=` to one of them, or to a list of consecutive containers that run one after the other (e.g."
            " ['layer1', 'layer2', 'layer3', 'layer4'])."
        )
    return best[0]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _share(module: nn.Module, container: nn.Module) -> str:
    total = _numel(module)
    return f"{100 * _numel(container) / total:.0f}%" if total else "none"


def _describe(container: nn.Module) -> str:
    """``4 x NanoBlock``, or for blocks of several classes ``3 x MllamaSelfAttentionDecoderLayer + 1 x ...``."""
    counts: dict[str, int] = {}
    for child in container._modules.values():
        if child is not None:
            counts[type(child).__name__] = counts.get(type(child).__name__, 0) + 1
    return " + ".join(f"{n} x {name}" for name, n in counts.items())


def _repeated_containers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Containers of blocks, not inside another such container: two or more children, either of one class with
    parameters, or of several classes each child with parameters and one class repeated (self- and cross-attention
    layers, Mamba and attention layers: Mllama's and Jamba's language models)."""
    found: list[tuple[str, nn.Module]] = []
    inside: set[int] = set()
    for name, sub in module.named_modules():
        if not name or id(sub) in inside or not isinstance(sub, _CONTAINERS):
            continue
        children = [c for c in sub._modules.values() if c is not None]  # a reused block counts each time
        if len(children) < 2 or not _holds_blocks(children):
            continue
        found.append((name, sub))
        inside.update(id(m) for m in sub.modules())
    return found


def _holds_blocks(children: list[nn.Module]) -> bool:
    classes = [type(c) for c in children]
    if len(set(classes)) == 1:
        return any(True for c in children for _ in c.parameters())
    repeated = max(classes.count(c) for c in set(classes)) > 1
    return repeated and all(any(True for _ in c.parameters()) for c in children)


def _resolve(module: nn.Module, path: str, spec: Union[str, Sequence[str]]) -> nn.Module:
    parent: nn.Module = module
    walked = []
    for part in path.split("."):
        walked.append(part)
        child = getattr(parent, part, None)
        if not isinstance(child, nn.Module):
            raise AttributeError(_missing_message(module, path, ".".join(walked), spec))
        parent = child
    if not isinstance(parent, _CONTAINERS):
        raise TypeError(
            f"`PipelineStrategy(backbone={spec!r})`: `{path}` is a `{type(parent).__name__}`, but the backbone must be"
            f" {_CONTAINER_NAMES} of blocks. Point `backbone=` at the container that holds the blocks (or a list"
            " of consecutive containers)."
        )
    return parent


def _missing_message(module: nn.Module, path: str, missing: str, spec: Union[str, Sequence[str]]) -> str:
    candidates = [n for n, m in module.named_modules() if n and isinstance(m, _CONTAINERS)]
    hint = f" Containers found: {candidates[:8]}." if candidates else " The module has no container of blocks."
    return (
        f"`PipelineStrategy(backbone={spec!r})`: `{type(module).__name__}` has no attribute `{missing}`."
        f" Set `backbone=` to the dotted path of {_CONTAINER_NAMES} of blocks, or to 'auto'.{hint}"
    )
