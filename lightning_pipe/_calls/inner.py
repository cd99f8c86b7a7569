"""Values that leave a block through a forward hook of a module inside it.

[Note: values from inside blocks] A block may hand out more than it returns: a forward hook on a module inside it
records that module's output for the code after the backbone. Hugging Face's output capturing works this way
(``_can_record_outputs``, ``OutputRecorder``, ``capture_outputs``): a mixture-of-experts model's router logits, which
the load-balancing loss reads after the blocks, are appended by a hook on each block's router (``MixtralTopKRouter``)
to a list that the model's ``forward`` returns. Such a value crosses stage boundaries like a block's output
([Note: stage boundaries] in :mod:`lightning_pipe._calls.flow`), as the producer ``("inner", path, call, leaf)``: tensor
``leaf`` of the ``call``-th output of the module at ``path`` inside a block.

- The setup's analysis records, per block, every call of a module inside it that has forward hooks of the model's own
  (:class:`InnerCall`: those present when the analysis ran, so not the hooks that tensor parallelism or sharding add
  later), and which of their outputs are used after the block.
- The stage that runs the block finds the value when the module returns (a hook of this package's own on the module).
- A stage that skips the block (it runs on an earlier stage) *replays* the block's recorded calls in their order: the
  model's hooks are called with the module's output made of the values received for it and ghosts for the rest, so
  what they record (the router logits' list) holds the received tensors, in the order one device records them, and
  their gradients flow back to the stage that computed them.

A value that leaves a block other than through its output or a forward hook (stored on a module, say) cannot be put
back where the code after the block reads it: that is refused at setup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_pipe._ghost import Ghost


@dataclass(frozen=True)
class InnerCall:
    """One call, inside block ``block``, of the module at ``path`` that has forward hooks of the model's own.

    Attributes:
        block: the block's index.
        path: the module's dotted path in the LightningModule.
        call: how many calls of that module came before this one in the step.
        out_spec: the tree of its output.
        out_leaves: its leaves, tensors as meta tensors.
        arg_leaves: its positional arguments, tensors as meta tensors (anything else ``None``).
        hooks: the ids of its forward hooks when the analysis ran.
    """

    block: int
    path: str
    call: int
    out_spec: TreeSpec
    out_leaves: tuple[Any, ...]
    arg_leaves: tuple[Optional[Tensor], ...]
    hooks: tuple[int, ...]


def record_call(block: int, path: str, call: int, module: nn.Module, args: Any, output: Any) -> Optional[InnerCall]:
    """The :class:`InnerCall` of a module's call inside a block, or ``None`` if the module has no forward hooks."""
    if not module._forward_hooks:
        return None
    leaves, spec = tree_flatten(output)
    positional = args if isinstance(args, tuple) else ()
    return InnerCall(
        block, path, call, spec, out_leaves=tuple(_meta(v) if isinstance(v, Tensor) else v for v in leaves),
        arg_leaves=tuple(_meta(a) if isinstance(a, Tensor) else None for a in positional),
        hooks=tuple(module._forward_hooks),
    )


def replay(
    module: nn.Module,
    calls: list[InnerCall],
    given: dict,
    sizes: Optional[dict[int, int]],
    device: torch.device,
    found: Callable[[tuple, Tensor], None],
) -> None:
    """Call the recorded hooks of a skipped block's ``calls`` with outputs made of the ``given`` values (by producer)
    and ghosts of the recorded shapes (resized by ``sizes``) for the rest; ``found(producer, value)`` sees every
    tensor leaf of those outputs."""
    for record in calls:
        sub = module.get_submodule(record.path)
        leaves = []
        for i, leaf in enumerate(record.out_leaves):
            producer = ("inner", record.path, record.call, i)
            value = given.get(producer)
            if value is None and isinstance(leaf, Tensor):
                value = _ghost(leaf, sizes, device)
            if isinstance(value, Tensor):
                found(producer, value)
            leaves.append(leaf if value is None else value)
        output = tree_unflatten(leaves, record.out_spec)
        args = tuple(None if a is None else _ghost(a, sizes, device) for a in record.arg_leaves)
        for hook_id in record.hooks:
            hook = sub._forward_hooks.get(hook_id)
            if hook is None:
                continue
            if sub._forward_hooks_with_kwargs.get(hook_id, False):
                result = hook(sub, args, {}, output)
            else:
                result = hook(sub, args, output)
            if result is not None:
                output = result


def inner_returned(program: Any, path: str, called: nn.Module, args: tuple, output: Any) -> None:
    """The forward hook on a module inside a block whose output crosses a boundary: the run in progress of
    ``program`` (a weak reference to the block runners) finds it; nothing while no run is (a checkpointed block
    recomputing in backward, after the step)."""
    runners = program()
    run = runners.current if runners is not None else None
    if run is not None:
        run.inner_output(path, output)


def _meta(t: Tensor) -> Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _ghost(meta: Tensor, sizes: Optional[dict[int, int]], device: torch.device) -> Ghost:
    shape = tuple(meta.shape) if sizes is None else tuple(sizes.get(d, d) for d in meta.shape)
    return Ghost(torch.empty(shape, dtype=meta.dtype, device="meta"), device)
