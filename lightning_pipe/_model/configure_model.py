"""What a ``configure_model`` written for Lightning's ``ModelParallelStrategy`` asked for, recorded while it ran.

[Note: configure_model's calls]
Lightning's ``ModelParallelStrategy`` runs ``configure_model`` on the whole module, which splits it with
``parallelize_module``, wraps blocks in ``checkpoint_wrapper`` and shards them with ``fully_shard`` (with a
``MixedPrecisionPolicy``). Under ``PipelineStrategy`` the module is cut into stages only after ``configure_model``,
and each rank must apply these to its own stage. So, while ``configure_model`` runs (``model_sharded_context``):

- ``parallelize_module`` (every ``ParallelStyle``) records ``(style, module, mesh)`` and splits nothing
  ([Note: tensor-parallel stages] says where the styles apply);
- ``fully_shard`` records ``(module, kwargs)`` and shards nothing (``_compat.parallel.fully_shard_recorded``);
- after it, each ``CheckpointWrapper`` child is put back by the module it wraps (the parameter names are the module's
  own again, as ``ModelParallelStrategy``'s state dicts give them), and the blocks it wrapped recompute their
  activations in backward.

:func:`sharding_of` turns the recorded ``fully_shard`` calls into the stage's sharding: ``data_parallel="fsdp"``, the
per-block ``reshard_after_forward`` and the ``MixedPrecisionPolicy``; what it cannot honour is refused with the
``PipelineStrategy`` argument that does the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Union

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_pipe._compat.parallel import fully_shard_recorded, parallel_styles_recorded
from lightning_pipe._compat.torch import checkpoint_wrappers
from lightning_pipe._model.tensor_parallel import Record
from lightning_pipe._parallel_dims import sharded_dims


@dataclass
class ConfigureModelCalls:
    """What ``configure_model`` asked for (see [Note: configure_model's calls]).

    Attributes:
        styles: ``(style, module, device_mesh)`` of each ``ParallelStyle`` ``parallelize_module`` applied.
        shards: ``(module or modules, kwargs)`` of each ``fully_shard`` call.
        checkpointed: the modules ``checkpoint_wrapper`` wrapped (now unwrapped).
    """

    styles: list[Record] = field(default_factory=list)
    shards: list[tuple[Union[nn.Module, list[nn.Module]], dict]] = field(default_factory=list)
    checkpointed: list[nn.Module] = field(default_factory=list)


@contextmanager
def recording(module: nn.Module) -> Iterator[ConfigureModelCalls]:
    """Record what the block (the user's ``configure_model``) asks of ``module`` instead of doing it."""
    calls = ConfigureModelCalls()
    with parallel_styles_recorded(lambda *record: calls.styles.append(record)), \
            fully_shard_recorded(lambda target, kwargs: calls.shards.append((target, kwargs))):
        yield calls
    unwrapped = {}
    for parent, name, wrapper, inner in checkpoint_wrappers(module):
        parent._modules[name] = inner
        unwrapped[id(wrapper)] = inner
        calls.checkpointed.append(inner)
    calls.shards = [(_unwrap(target, unwrapped), kwargs) for target, kwargs in calls.shards]
    calls.styles = [(style, unwrapped.get(id(target), target), mesh) for style, target, mesh in calls.styles]


def _unwrap(
    target: Union[nn.Module, list[nn.Module]], unwrapped: dict[int, nn.Module]
) -> Union[nn.Module, list[nn.Module]]:
    if isinstance(target, nn.Module):
        return unwrapped.get(id(target), target)
    return [unwrapped.get(id(m), m) for m in target]


@dataclass(frozen=True)
class RecordedSharding:
    """The stage sharding ``configure_model``'s ``fully_shard`` calls ask for."""

    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: dict[int, bool]  # by id of the block


_HONOURED = {"mesh", "reshard_after_forward", "mp_policy"}


def sharding_of(calls: ConfigureModelCalls, blocks: list[nn.Module], data_parallel: Optional[str]) -> Optional[
    RecordedSharding
]:
    """The sharding the recorded ``fully_shard`` calls ask for (``None``: no call), checked on every rank alike.
    ``data_parallel``: the ``PipelineStrategy`` argument (``None``: not given). Raises ``ValueError`` naming the fix."""
    if not calls.shards:
        return None
    if data_parallel not in (None, "fsdp"):
        raise ValueError(
            f"`configure_model` calls `fully_shard`, which shards each stage over its replicas, but"
            f" `PipelineStrategy(data_parallel={data_parallel!r})` asks for another layout. Drop the argument (or pass"
            " 'fsdp') to shard as `configure_model` does, or remove the `fully_shard` calls."
        )
    block_ids = {id(b) for b in blocks}
    policies: list[MixedPrecisionPolicy] = []
    reshard: dict[int, bool] = {}
    for target, kwargs in calls.shards:
        unknown = sorted(set(kwargs) - _HONOURED)
        if unknown:
            raise ValueError(
                f"`configure_model` calls `fully_shard(..., {', '.join(f'{k}=...' for k in unknown)})`:"
                " `PipelineStrategy` shards each stage itself and honours `mesh`, `reshard_after_forward` and"
                " `mp_policy` only. Remove the other arguments."
            )
        mesh = kwargs.get("mesh")
        spanned = sharded_dims(mesh) if mesh is not None else []
        if len(spanned) > 1:  # a mesh whose other dimensions have one process (Lightning's fp8 example) is plain
            raise ValueError(
                f"`configure_model` calls `fully_shard` with a mesh of several dimensions ({', '.join(spanned)})"
                " (hybrid sharding): pass `PipelineStrategy(data_parallel='hsdp')` instead and remove the call."
            )
        policies.append(kwargs.get("mp_policy", MixedPrecisionPolicy()))
        modules = [target] if isinstance(target, nn.Module) else list(target)
        for m in modules:
            if id(m) in block_ids:
                reshard[id(m)] = bool(kwargs.get("reshard_after_forward", True))
    if any(p != policies[0] for p in policies):
        raise ValueError(
            "`configure_model` gives `fully_shard` different `MixedPrecisionPolicy`s: under `PipelineStrategy` one"
            " policy applies to every unit. Pass the same `mp_policy` to every call."
        )
    return RecordedSharding(policies[0], reshard)
