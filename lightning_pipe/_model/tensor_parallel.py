"""Tensor parallelism inside each stage: this rank's blocks split over the processes of its ``"tensor_parallel"``
mesh dimension with torch's ``parallelize_module`` (``PipelineStrategy(tensor_parallel_size=T,
tensor_parallel_plan=...)``).

[Note: tensor-parallel stages]
The plan is applied after the cut, to this rank's blocks only: blocks another stage owns cost this rank nothing. A
plan is a ``parallelize_module`` plan relative to one block (``{"attn.q_proj": "colwise", "mlp.*_proj": ...}``,
wildcards as ``parallelize_module`` takes them; ``"colwise"``/``"rowwise"`` or ``ParallelStyle`` objects), a callable
``(block, tp_mesh) -> None``, or ``"auto"``: a Hugging Face model's own ``config.base_model_tp_plan``, its
``layers.*.`` prefix taken off. Modules outside the backbone (embedding, head) stay replicated over the tensor ranks.

A block's output is a plain tensor, the same on every tensor rank (a row-wise layer ends with an all-reduce), so the
stages hand each other plain activations: pipeline rank ``k`` of tensor rank ``t`` talks to pipeline rank ``k + 1``
of the same tensor rank. Sequence-parallel plans (an activation sharded along the sequence) are refused.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Optional, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

#: ``tensor_parallel_plan``: a plan relative to a block, a callable, ``"auto"`` or ``None``.
TensorParallelPlan = Union[None, str, dict, Callable[[nn.Module, DeviceMesh], None]]
_STYLES: dict[str, Callable[[], ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def block_plan(plan: TensorParallelPlan, module: nn.Module) -> Optional[Union[dict, Callable]]:
    """The plan to apply to each block: a dict of ``ParallelStyle`` by block-relative path, or the user's callable;
    ``None`` without tensor parallelism. Raises ``ValueError`` naming the fix for what it cannot honour."""
    if plan is None:
        return None
    if callable(plan) and not isinstance(plan, str):
        return plan
    if plan == "auto":
        plan = _hugging_face_plan(module)
    if not isinstance(plan, dict) or not plan:
        raise ValueError(
            f"`PipelineStrategy(tensor_parallel_plan={plan!r})` is not a plan: pass a dict of `parallelize_module`"
            " styles by module path within a block (`{'attn.q_proj': 'colwise', 'attn.o_proj': 'rowwise'}`), a"
            " callable `(block, tp_mesh) -> None`, or 'auto' for a Hugging Face model's own plan."
        )
    styles = {}
    for path, style in plan.items():
        if isinstance(style, str):
            if style not in _STYLES:
                raise ValueError(
                    f"`tensor_parallel_plan` gives `{path}` the style {style!r}: PipelineStrategy takes 'colwise' and"
                    " 'rowwise' by name (sequence-parallel and gathering styles split activations that the pipeline"
                    " hands to the next stage whole); pass a `ParallelStyle` object for anything else."
                )
            style = _STYLES[style]()
        _refuse_sequence_parallel(path, style)
        styles[path] = style
    return styles


def _hugging_face_plan(module: nn.Module) -> dict:
    for sub in module.modules():
        config = getattr(sub, "config", None)
        plan = getattr(config, "base_model_tp_plan", None)
        if plan:
            blocks = {}
            for key, style in plan.items():
                head, sep, rest = key.partition(".*.")
                if sep:  # per layer: relative to one block
                    blocks[rest] = style
            if blocks:
                return blocks
    raise ValueError(
        "`PipelineStrategy(tensor_parallel_plan='auto')` takes a Hugging Face model's `config.base_model_tp_plan`, but"
        " this model has none with per-layer entries. Pass a plan: `{'path.in.block': 'colwise' | 'rowwise'}`."
    )


def _refuse_sequence_parallel(path: str, style: Any) -> None:
    """A block's input and output must stay whole on every tensor rank: the pipeline hands them on."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import SequenceParallel

    whole = True
    if isinstance(style, SequenceParallel) or getattr(style, "use_local_output", True) is False:
        whole = False
    elif isinstance(style, ColwiseParallel):
        whole = all(isinstance(p, Replicate) for p in _as_tuple(style.input_layouts))
    elif isinstance(style, RowwiseParallel):
        whole = all(isinstance(p, Replicate) for p in _as_tuple(style.output_layouts))
    if not whole:
        raise ValueError(
            f"`tensor_parallel_plan` shards the activations of `{path}` along the sequence ({type(style).__name__}"
            " with sharded input or output layouts, or a DTensor output): sequence-parallel plans are not supported"
            " under the pipeline, which hands each block's output on whole. Use ColwiseParallel and RowwiseParallel"
            " with their default layouts."
        )


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def check_plan(styles: dict, block: nn.Module, block_name: str, size: int) -> None:
    """Every key names a module of the block, and the sizes it splits divide ``size``; raises ``ValueError``."""
    modules = dict(block.named_modules())
    for path, style in styles.items():
        matched = [name for name in modules if name and fnmatch.fnmatch(name, path)]
        if not matched:
            children = ", ".join(name for name in modules if name and "." not in name)
            raise ValueError(
                f"`tensor_parallel_plan` names `{path}`, which is no module of the block `{block_name}` (its modules:"
                f" {children}). Plan keys are paths within one block, as `block.named_modules()` gives them."
            )
        for name in matched:
            linear = modules[name]
            if not isinstance(linear, nn.Linear):
                continue
            split, what = (
                (linear.out_features, "output features") if isinstance(style, ColwiseParallel)
                else (linear.in_features, "input features")
            )
            if split % size:
                raise ValueError(
                    f"`tensor_parallel_size={size}` does not divide the {split} {what} of `{block_name}.{name}`"
                    f" ({type(style).__name__}). Pick a tensor_parallel_size that divides the hidden and head sizes,"
                    " or leave the module out of `tensor_parallel_plan`."
                )


def parallelize_block(plan: Union[dict, Callable], block: nn.Module, mesh: DeviceMesh) -> None:
    """Split one block over the tensor-parallel ``mesh``."""
    if isinstance(plan, dict):
        parallelize_module(block, mesh, dict(plan))
    else:
        plan(block, mesh)
