"""Tensor parallelism inside each stage: this rank's blocks split over the processes of its ``"tensor_parallel"``
mesh dimension with torch's ``parallelize_module`` (``PipelineStrategy(tensor_parallel_size=T,
tensor_parallel_plan=...)``).

[Note: tensor-parallel stages]
Tensor parallelism is applied after the cut, to this rank's own modules only: modules another stage owns cost this
rank nothing. It comes from one of two routes:

- ``tensor_parallel_plan=``: a ``parallelize_module`` plan relative to one block (``{"attn.q_proj": "colwise",
  "mlp.*_proj": ...}``, wildcards as ``parallelize_module`` takes them; ``"colwise"``/``"rowwise"`` or
  ``ParallelStyle`` objects), a callable ``(block, tp_mesh) -> None``, or ``"auto"``: a Hugging Face model's own
  ``config.base_model_tp_plan``, its ``layers.*.`` prefix taken off. It splits the blocks only, so it must leave a
  block's input and output whole: sequence-parallel styles are refused, and the modules outside the backbone stay
  replicated.
- what a ``configure_model`` written for Lightning's ``ModelParallelStrategy`` asks ``parallelize_module`` for,
  recorded while it runs ([Note: configure_model's calls]): each style applies to the block or the module outside
  the backbone (embedding, final norm, head) that it names, on the rank that holds it. Sequence parallelism works:
  a block then takes and returns this tensor rank's shard of the sequence as a plain tensor (``PrepareModuleInput``
  and ``RowwiseParallel(output_layouts=Shard(1))`` with local outputs), and that shard is what the stage sends.

Either way the stages hand each other plain tensors: pipeline rank ``k`` of tensor rank ``t`` talks to pipeline rank
``k + 1`` of the same tensor rank, so a sequence-parallel boundary moves ``1 / tensor_parallel_size`` of the
activation per rank. A loss computed on vocabulary-sharded logits under ``loss_parallel()`` is a replicated DTensor;
the runtime weighs and back-propagates it as the plain tensor every tensor rank holds (``_step/loss_weights.py``:
``whole``), through the user's ``backward`` override ([Note: backward overrides]).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

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


def _refuse_sequence_parallel(path: str, style: ParallelStyle) -> None:
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


def _as_tuple(value: Union[Placement, Sequence[Placement]]) -> tuple[Placement, ...]:
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
            _check_split(f"{block_name}.{name}", modules[name], style, size)


def _check_split(name: str, module: nn.Module, style: ParallelStyle, size: int) -> None:
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):
        split, what = (module.out_features, "output features") if colwise else (module.in_features, "input features")
    elif isinstance(module, nn.Embedding):
        split, what = (module.embedding_dim, "embedding features") if colwise else (module.num_embeddings, "rows")
    else:
        return
    if split % size:
        raise ValueError(
            f"`tensor_parallel_size={size}` does not divide the {split} {what} of `{name}` ({type(style).__name__})."
            " Pick a tensor_parallel_size that divides the hidden and head sizes, or leave the module out of the"
            " tensor-parallel plan."
        )


#: ``(style, module, device_mesh)``: what a ``configure_model`` asked ``parallelize_module`` for.
Record = tuple[ParallelStyle, nn.Module, DeviceMesh]


@dataclass(frozen=True)
class TensorParallelSplit:
    """How this rank's modules are split over its tensor ranks: ``block(block, tp_mesh)`` for each local block and,
    when the plan also splits modules outside the backbone (a recorded ``configure_model``), ``outside(module,
    tp_mesh)`` for each outside module this rank holds."""

    block: Callable[[nn.Module, DeviceMesh], None]
    outside: Optional[Callable[[nn.Module, DeviceMesh], None]] = None


def recorded_plan(
    records: list[Record], module: nn.Module, blocks: list[tuple[str, nn.Module]], size: int
) -> TensorParallelSplit:
    """What the user's ``configure_model`` asked ``parallelize_module`` for, applied to each of this rank's blocks and
    to the modules outside the backbone it holds (embedding, final norm, head: [Note: tensor-parallel stages]);
    checked on every rank alike (the records are): no style splits a container of blocks, and the sizes divide.
    Raises ``ValueError`` naming the fix."""
    names = {id(m): n for n, m in module.named_modules()}
    block_ids = {id(block) for _, block in blocks}
    for style, target, _ in records:
        name = names.get(id(target), type(target).__name__)
        if id(target) not in block_ids and any(id(sub) in block_ids for sub in target.modules()):
            raise ValueError(
                f"`configure_model` applies {type(style).__name__} to `{name}`, which holds pipelined blocks: under"
                " `PipelineStrategy` each stage holds only some of them. Apply the style to the blocks themselves"
                " (`layers.0`) or to the modules outside them (embedding, norm, head)."
            )
        if not _has_weights(target) and not _inside_block(target, blocks):
            raise ValueError(
                f"`configure_model` applies {type(style).__name__} to `{name}`, a module outside the pipelined blocks"
                " without parameters: the strategy cannot tell which stage runs it. Apply the style to a block or to"
                " a module with parameters (embedding, norm, head)."
            )
        _check_split(name, target, style, size)

    def apply(part: nn.Module, mesh: DeviceMesh) -> None:
        inside = {id(m) for m in part.modules()}
        for style, target, device_mesh in records:
            if id(target) in inside:
                type(style)._apply(style, target, device_mesh)

    return TensorParallelSplit(block=apply, outside=apply)


def _has_weights(module: nn.Module) -> bool:
    """Whether ``module`` has parameters, this rank's or (after the cut) another rank's, which are ghosts here."""
    from lightning_pipe._ghost import Ghost

    return any(True for _ in module.parameters()) or any(
        isinstance(value, Ghost) for sub in module.modules() for value in vars(sub).values()
    )


def _inside_block(target: nn.Module, blocks: list[tuple[str, nn.Module]]) -> bool:
    return any(target is sub for _, block in blocks for sub in block.modules())


def parallelize_block(plan: Union[dict, Callable], block: nn.Module, mesh: DeviceMesh) -> None:
    """Split one block over the tensor-parallel ``mesh``."""
    if isinstance(plan, dict):
        parallelize_module(block, mesh, dict(plan))
    else:
        plan(block, mesh)


def choose_plan(
    plan: TensorParallelPlan, records: list[Record], size: int, module: nn.Module, blocks: list[tuple[str, nn.Module]]
) -> Optional[TensorParallelSplit]:
    """How to split this rank's modules: from ``tensor_parallel_plan`` (the blocks only), or from what the user's
    ``configure_model`` asked ``parallelize_module`` for (``records``); ``None`` without tensor parallelism. The same
    on every rank; raises ``ValueError`` naming the fix."""
    if size == 1:
        if records:
            raise ValueError(
                "`configure_model` calls `parallelize_module`, but `PipelineStrategy(tensor_parallel_size=1)` gives"
                " it no tensor ranks. Set `tensor_parallel_size` to the processes that split each block."
            )
        return None
    if plan is not None:
        if records:
            raise ValueError(
                "Both `PipelineStrategy(tensor_parallel_plan=...)` and `configure_model` (through `parallelize_module`)"
                " say how to split the blocks. Keep one of them."
            )
        styles = block_plan(plan, module)
        assert styles is not None
        if isinstance(styles, dict):
            check_plan(styles, blocks[0][1], blocks[0][0], size)
        if plan == "auto":
            _check_heads(module, size)
        return TensorParallelSplit(block=lambda block, mesh: parallelize_block(styles, block, mesh))
    if records:
        return recorded_plan(records, module, blocks, size)
    raise ValueError(
        f"`PipelineStrategy(tensor_parallel_size={size})` needs to know how to split each block: pass"
        " `tensor_parallel_plan=` (a `parallelize_module` plan relative to one block, a callable `(block, tp_mesh)`,"
        " or 'auto' for a Hugging Face model's own plan), or call `parallelize_module` on the blocks in"
        " `configure_model` with `self.device_mesh['tensor_parallel']`, as for Lightning's `ModelParallelStrategy`."
    )


def _check_heads(module: nn.Module, size: int) -> None:
    """A Hugging Face attention splits its heads over the tensor ranks: their counts must divide."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "base_model_tp_plan", None):
            for name in ("num_attention_heads", "num_key_value_heads"):
                heads = getattr(config, name, None)
                if isinstance(heads, int) and heads % size:
                    raise ValueError(
                        f"`tensor_parallel_size={size}` does not divide the model's {heads} {name.replace('_', ' ')}"
                        f" (`config.{name}`): each tensor rank takes whole heads. Pick a tensor_parallel_size that"
                        " divides the head counts."
                    )
            return
