"""torch's private names of FSDP2 and tensor parallelism the package needs, and the workarounds that use them (see
:mod:`lightning_pipe._compat`): FSDP2's deferred and in-backward reductions, the recording of ``parallelize_module``'s
styles and of ``fully_shard``'s calls in ``configure_model``, and undoing both after a Trainer call."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.tensor.parallel import ParallelStyle


# ---------------------------------------------------------------------------------------------- FSDP2 (fully_shard)
# torch 2.13's public FSDP2 surface (`fully_shard`, `FSDPModule.unshard/reshard/set_*`) drives one backward per step.
# A pipeline runs one backward per microbatch and learns the step's loss weights only after the last one (see
# `_step/loss_weights.py`), so the strategy defers the reduce-scatter as torch's own `PipelineStage` does for an
# `FSDPModule` (`perform_reduce_grad`: the `FSDPParamGroup.post_backward` of every group, then the root's final
# callback), scales the accumulated unsharded gradients first, and keeps FSDP's forward hooks out of the runs on
# ghosts (shape probes), which must not all-gather. Checked against torch 2.13, 2.14 and 2.15.


def fsdp_state(unit: FSDPModule) -> FSDPState:
    """The ``FSDPState`` of a module ``fully_shard`` was applied to."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(unit)  # type: ignore[attr-defined]


def fsdp_params(unit: FSDPModule) -> list[FSDPParam]:
    """The ``FSDPParam`` objects of a unit (its sharded and unsharded parameters, and its accumulated gradients)."""
    group = fsdp_state(unit)._fsdp_param_group
    return list(group.fsdp_params) if group is not None else []


def fsdp_sharded_params(unit: FSDPModule) -> list[torch.nn.Parameter]:
    """The sharded parameters of a unit, whether it is sharded now or not (while unsharded, the module registers its
    unsharded parameters instead)."""
    return [p.sharded_param for p in fsdp_params(unit)]


def fsdp_lazy_init(unit: FSDPModule) -> None:
    """Initialise the unit as its own root now, as its first forward would."""
    fsdp_state(unit)._lazy_init()


def fsdp_modules_in(module: torch.nn.Module) -> list[torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class fsdp_hooks_suspended:
    """Within the block, FSDP's forward hooks of every sharded module under ``module`` do not run: a run on ghosts
    (a shape probe) neither all-gathers nor swaps parameters. The hook tables are restored as they were."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.saved: list[tuple[dict, dict]] = []

    def __enter__(self) -> None:
        for m in fsdp_modules_in(self.module):
            for table in (m._forward_pre_hooks, m._forward_hooks):
                state_hooks = [
                    k for k, fn in table.items() if type(getattr(fn, "__self__", None)).__name__ == "FSDPState"
                ]
                if state_hooks:
                    self.saved.append((table, dict(table)))
                    for k in state_hooks:
                        del table[k]

    def __exit__(self, *exc: object) -> None:
        for table, before in reversed(self.saved):
            table.clear()
            table.update(before)
        self.saved.clear()


def fsdp_defer_reduction(unit: FSDPModule) -> None:
    """Accumulate this step's microbatch gradients unsharded, with no reduce-scatter and no reshard in backward."""
    unit.set_is_last_backward(False)
    unit.set_reshard_after_backward(False)
    unit.set_requires_gradient_sync(False)


def fsdp_scale_unsharded_grads(unit: FSDPModule, scale: float) -> None:
    """Multiply the unsharded gradients the unit accumulated this step by ``scale`` (before they are reduced)."""
    grads: dict[int, torch.Tensor] = {}  # by identity: from torch 2.15 the accumulated one is the ``.grad``
    for p in fsdp_params(unit):
        if p.unsharded_accumulated_grad is not None:
            grads.setdefault(id(p.unsharded_accumulated_grad), p.unsharded_accumulated_grad)
        if hasattr(p, "_unsharded_param") and p.unsharded_param.grad is not None:
            grads.setdefault(id(p.unsharded_param.grad), p.unsharded_param.grad)
    if grads:
        torch._foreach_mul_(list(grads.values()), scale)


def fsdp_reduce_now(unit: FSDPModule) -> None:
    """Reduce-scatter (and, for HSDP, all-reduce) the accumulated gradients into the sharded ``.grad`` and reshard,
    as ``PipelineStage.perform_reduce_grad`` does for an ``FSDPModule``."""
    unit.set_is_last_backward(True)
    unit.set_reshard_after_backward(True)
    unit.set_requires_gradient_sync(True)
    state = fsdp_state(unit)
    for group in state._fsdp_param_groups:
        group.post_backward()
    context = state._state_ctx
    if getattr(context, "manual_backward_finalization_active", False) is None:
        # torch 2.15: a backward fixes the finalization mode when it queues this callback, and the callback asserts
        # it is fixed. This call runs after the step's backwards, as the callback of one: fix the mode a backward
        # would (automatic; the stages never ask for manual finalization). The callback's end clears it again.
        context.manual_backward_finalization_active = context.manual_backward_finalization
    state._root_post_backward_final_callback()


def fsdp_reduce_in_backward(
    unit: FSDPModule, around: Callable[[Callable[[float], None]], None]
) -> Callable[[], None]:
    """Let ``unit`` reduce-scatter in its own post-backward hook during the next backward, as FSDP does outside a
    pipeline, with ``around(reduce)`` wrapping each call: ``reduce(scale)`` multiplies the accumulated unsharded
    gradients by ``scale`` and runs FSDP's post-backward. Returns the function that puts the unit back to deferred
    reduction. The wrapper is an instance attribute of each ``FSDPParamGroup``: FSDP's autograd function calls
    ``param_group.post_backward()`` through it."""
    unit.set_is_last_backward(True)
    unit.set_reshard_after_backward(True)
    unit.set_requires_gradient_sync(True)
    groups = list(fsdp_state(unit)._fsdp_param_groups)
    for group in groups:
        original = group.post_backward

        def post_backward(*args: Any, _original: Callable[..., None] = original) -> None:
            def reduce(scale: float) -> None:
                if scale != 1.0:
                    fsdp_scale_unsharded_grads(unit, scale)
                return _original(*args)

            return around(reduce)

        group.post_backward = post_backward

    def undo() -> None:
        for group in groups:
            vars(group).pop("post_backward", None)
        fsdp_defer_reduction(unit)

    return undo


# ---------------------------------------------------------------------------------------------- tensor parallelism
@contextmanager
def parallel_styles_recorded(record: Callable[[ParallelStyle, torch.nn.Module, DeviceMesh], object]) -> Iterator[None]:
    """Within the block, ``parallelize_module`` (and every other use of torch's own ``ParallelStyle`` classes) records
    ``record(style, module, device_mesh)`` instead of splitting the module: a ``configure_model`` written for
    Lightning's ``ModelParallelStrategy`` runs before the pipeline cut, and the strategy applies what it asked for to
    each rank's own blocks after it. ``parallelize_module`` applies a plan through each style's ``_apply(module,
    device_mesh)``; the classes' ``_apply`` are swapped for the duration (torch 2.13 to 2.15)."""
    from torch.distributed.tensor.parallel import style as styles

    classes = [
        c for c in vars(styles).values()
        if isinstance(c, type) and issubclass(c, styles.ParallelStyle) and "_apply" in vars(c)
        and c is not styles.ParallelStyle
    ]
    saved = {c: vars(c)["_apply"] for c in classes}

    def recorded(self: ParallelStyle, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        record(self, module, device_mesh)
        return module

    for c in classes:
        c._apply = recorded  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for c, original in saved.items():
            c._apply = original  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- configure_model's FSDP
@contextmanager
def fully_shard_recorded(
    record: Callable[[Union[torch.nn.Module, list[torch.nn.Module]], dict[str, Any]], object]
) -> Iterator[None]:
    """Within the block, ``fully_shard(module, **kwargs)`` records ``record(module, kwargs)`` and leaves the module as
    it is: a ``configure_model`` written for Lightning's ``ModelParallelStrategy`` runs before the pipeline cut, and
    the strategy shards each rank's own stage after it, as that call asked ([Note: configure_model's calls]).

    Users import ``fully_shard`` by name (from ``torch.distributed.fsdp`` or the older
    ``torch.distributed._composable.fsdp``), so replacing a module attribute would intercept nothing. ``fully_shard``
    is ``contract(state_cls=FSDPState)`` around the function that shards: the one function object every import
    name binds to keeps that function in a closure cell, swapped here for the recorder while the block runs.
    ``contract``'s wrapper also registers an empty state on the module (under ``contract``'s ``STATE_KEY`` and
    ``REGISTRY_KEY``), taken off again, so that the strategy's own ``fully_shard`` can apply later (torch 2.13 to
    2.15)."""
    import importlib

    from torch.distributed.fsdp import fully_shard

    contract_module = importlib.import_module("torch.distributed._composable.contract")

    cells = [c for c in (fully_shard.__closure__ or ()) if callable(c.cell_contents)
             and getattr(c.cell_contents, "__name__", "") == "fully_shard"]
    if len(cells) != 1:
        raise RuntimeError("lightning_pipe: this torch's `fully_shard` has no inner function to record (2.13-2.15 do).")
    cell, original = cells[0], cells[0].cell_contents
    touched: list[torch.nn.Module] = []

    def recorded(
        module: Union[torch.nn.Module, list[torch.nn.Module]], *args: Any, **kwargs: Any
    ) -> Union[torch.nn.Module, list[torch.nn.Module]]:
        if args:
            raise TypeError("fully_shard takes its options as keyword arguments")
        modules = [module] if isinstance(module, torch.nn.Module) else list(module)
        touched.extend(modules)
        record(module, kwargs)
        return module

    recorded.__name__ = original.__name__  # the registry key `contract` takes
    cell.cell_contents = recorded
    try:
        yield
    finally:
        cell.cell_contents = original
        for module in touched:
            vars(module).get(contract_module.STATE_KEY, {}).pop(recorded, None)
            vars(module).get(contract_module.REGISTRY_KEY, {}).pop("fully_shard", None)


# [Note: undoing a stage's parallelization]
# After a Trainer call the module becomes whole again (`_model/whole.py`): every module `parallelize_stage` touched
# must be a plain module once more, or a forward on one rank would all-gather (FSDP's hooks) or redistribute
# (tensor-parallel hooks) alone and hang. torch has no public inverse of `fully_shard` or `parallelize_module`:
# `fully_shard` swaps the class for `FSDP<Class>`, adds forward and state-dict hooks, stores its state in the
# module's `__dict__` (`contract`'s registry) and in `torch.distributed._composable_state._module_state_mapping`;
# `parallelize_module` adds forward hooks. So the setup takes a snapshot of every module's class, hook tables and
# `__dict__` keys before it parallelizes and of the hooks it added, and `restore_modules` takes those hooks out and
# puts the rest back (parameters are set afterwards by the caller); hooks added after the parallelization stay:
# Hugging Face's output-capturing hooks, installed at a model's first forward that records, with a mark on the model
# that it would not install them again. Checked against torch 2.13, 2.14 and 2.15.
_HOOK_TABLES = (
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks", "_state_dict_pre_hooks",
    "_state_dict_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


#: What ``distribute_module`` (under ``parallelize_module``) marks a module with; ``contract``'s state and registry
#: keys (``fully_shard``) start with ``__``.
_PARALLEL_MARKS = ("_distribute_module_applied",)


class ModuleSnapshot:
    """Each module's class, hook tables and ``__dict__`` keys as they were (:func:`restore_modules`), and, once
    :meth:`parallelized`, the hooks the parallelization added: only those are taken out again, so that hooks added
    later stay (Hugging Face installs its output-capturing hooks at a model's first forward that records)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.entries = [
            (m, type(m), {t: dict(getattr(m, t)) for t in _HOOK_TABLES if hasattr(m, t)}, set(m.__dict__))
            for m in module.modules()
        ]
        self.added: Optional[list[dict[str, set]]] = None

    def parallelized(self) -> None:
        """The parallelization is done: remember the hooks it added."""
        self.added = [
            {name: set(getattr(m, name)) - set(before) for name, before in tables.items()}
            for m, _, tables, _ in self.entries
        ]


def restore_modules(snapshot: ModuleSnapshot) -> None:
    """Give every module of ``snapshot`` its class, hook tables and ``__dict__`` keys back, and forget FSDP's state
    for it, so that ``fully_shard`` may be applied to it again ([Note: undoing a stage's parallelization])."""
    from torch.distributed import _composable_state

    for i, (m, cls, tables, keys) in enumerate(snapshot.entries):
        _composable_state._module_state_mapping.pop(m, None)
        if type(m) is not cls:
            m.__class__ = cls
        for name, before in tables.items():
            table = getattr(m, name)
            if snapshot.added is None:
                table.clear()
            else:
                for key in snapshot.added[i][name]:
                    table.pop(key, None)
            table.update(before)
        for key in [k for k in m.__dict__ if k not in keys and (k.startswith("__") or k in _PARALLEL_MARKS)]:
            del m.__dict__[key]
