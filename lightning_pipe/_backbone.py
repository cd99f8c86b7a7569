"""The user's backbone: finding it, keeping only the local stages, and intercepting its calls.

The strategy runs the user's unchanged ``*_step`` methods around the pipeline. The backbone is replaced by a
:class:`LocalBackbone` that holds only this rank's modules under their original indices, so that
``state_dict()`` keeps the original names. Calling it does not run the modules: it hands the call to the
strategy, which either captures the input (first-stage side) or returns the pipeline's output
(last-stage side).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_pipe._logging import LogRecorder


class BackboneCallError(RuntimeError):
    """The user's step called the pipelined backbone in a way the pipeline cannot run."""

    __module__ = "lightning_pipe"  # its public home


class _InputCaptured(Exception):
    """Raised by the capturing handler to stop the user's step right after the backbone input is known."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args = args
        self.kwargs = kwargs


class LocalBackbone(nn.Sequential):
    """This rank's slice of the backbone, keyed by the original indices (``"7"`` stays ``"7"``).

    Args:
        modules: the original backbone, split already; only ``keep`` are retained.
        keep: the backbone indices this rank runs.
        num_modules: the length of the original backbone, kept for information and re-setup.
    """

    def __init__(self, modules: nn.Sequential, keep: list[int], num_modules: int) -> None:
        super().__init__(OrderedDict((str(i), modules[i]) for i in keep))
        self.num_modules = num_modules
        self.indices = list(keep)
        self._handler: Optional[Callable[..., Any]] = None
        self.layout: Any = None  # the StageLayout it was split with, set by the strategy
        self.stage_wrappers: dict[Any, nn.Module] = {}  # runtime wrappers (DDP, checkpointing), not submodules

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._handler is None:
            raise BackboneCallError(
                "The pipelined backbone holds only this rank's stages and cannot be called outside the"
                " `training_step`, `validation_step`, `test_step` or `predict_step` that `PipelineStrategy` runs."
            )
        return self._handler(*args, **kwargs)

    def module_at(self, index: int) -> nn.Module:
        return self._modules[str(index)]  # type: ignore[return-value]

    @contextmanager
    def handled_by(self, handler: Callable[..., Any]) -> Iterator[None]:
        self._handler = handler
        try:
            yield
        finally:
            self._handler = None


def resolve_backbone(module: nn.Module, path: str) -> tuple[nn.Module, str, nn.Module]:
    """Find the attribute ``path`` (dotted) on ``module``.

    Returns:
        ``(parent, attribute_name, backbone)``.
    """
    parent: nn.Module = module
    *parents, name = path.split(".")
    walked = []
    for part in parents:
        walked.append(part)
        child = getattr(parent, part, None)
        if not isinstance(child, nn.Module):
            raise AttributeError(_missing_backbone_message(module, path, ".".join(walked)))
        parent = child
    backbone = getattr(parent, name, None)
    if backbone is None:
        raise AttributeError(_missing_backbone_message(module, path, path))
    if not isinstance(backbone, nn.Sequential):
        raise TypeError(
            f"`PipelineStrategy(backbone={path!r})` must name an `nn.Sequential`, but `{path}` is a"
            f" `{type(backbone).__name__}`. Wrap the layers to pipeline in one `nn.Sequential` attribute, or point"
            " `backbone=` at the attribute that is one."
        )
    return parent, name, backbone


def _missing_backbone_message(module: nn.Module, path: str, missing: str) -> str:
    candidates = [n for n, m in module.named_modules() if n and isinstance(m, nn.Sequential)]
    hint = f" Sequential modules found: {candidates[:8]}." if candidates else " The module has no nn.Sequential."
    return (
        f"`PipelineStrategy(backbone={path!r})`: `{type(module).__name__}` has no attribute `{missing}`."
        f" Set `backbone=` to the dotted attribute path of the nn.Sequential to pipeline.{hint}"
    )


def capture_input(
    backbone: LocalBackbone, step: Callable[..., Any], *step_args: Any, **step_kwargs: Any
) -> tuple[tuple, dict]:
    """Run ``step`` until it calls the backbone and return the call's ``(args, kwargs)``."""

    def handler(*args: Any, **kwargs: Any) -> Any:
        raise _InputCaptured(args, kwargs)

    with backbone.handled_by(handler):
        try:
            step(*step_args, **step_kwargs)
        except _InputCaptured as captured:
            return captured.args, captured.kwargs
    raise BackboneCallError(
        "The step finished without calling the pipelined backbone. With `PipelineStrategy`, each"
        " `training_step`/`validation_step`/`test_step`/`predict_step` must call the backbone (directly or through"
        " `forward`) exactly once per batch."
    )


def run_with_output(
    backbone: LocalBackbone, output: Any, step: Callable[..., Any], *step_args: Any, **step_kwargs: Any
) -> Any:
    """Run ``step`` with the backbone call answered by ``output``; the backbone must be called exactly once."""
    calls = 0

    def handler(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise BackboneCallError(
                "The step called the pipelined backbone twice. With `PipelineStrategy`, the backbone runs once"
                " per batch: call it once and reuse its output."
            )
        return output

    with backbone.handled_by(handler):
        result = step(*step_args, **step_kwargs)
    if calls == 0:
        raise BackboneCallError("The step did not call the pipelined backbone on the last stage.")
    return result


def capture_inputs(
    module: nn.Module, backbone: LocalBackbone, step: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[Tensor, ...]:
    """The backbone input of this batch, found by running ``step`` up to the backbone call."""
    with LogRecorder().installed(module):  # the last stage logs this part per microbatch
        inputs, input_kwargs = capture_input(backbone, step, *args, **kwargs)
    if input_kwargs or len(inputs) != 1 or not isinstance(inputs[0], Tensor):
        raise BackboneCallError(
            "The pipelined backbone is an `nn.Sequential` and must be called with exactly one tensor, batch"
            f" dimension first; it was called with {len(inputs)} positional and {len(input_kwargs)} keyword"
            " arguments."
        )
    batch_size_of(inputs, input_kwargs)
    return inputs


def loss_of(result: Any) -> Tensor:
    """The loss in what ``training_step`` returned."""
    loss = result.get("loss") if isinstance(result, dict) else result
    if not isinstance(loss, Tensor):
        raise BackboneCallError(
            "Under `PipelineStrategy`, `training_step` must return the loss tensor (or a dict with 'loss') for every"
            f" microbatch; it returned {type(result).__name__}. Skipping a step by returning None is not supported."
        )
    return loss


def batch_size_of(args: tuple, kwargs: dict) -> int:
    """The batch size of the backbone input: the first dimension of its first tensor."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise BackboneCallError(
        "The backbone was called without a batched tensor input. `PipelineStrategy` splits the backbone input"
        " along dimension 0 into microbatches, so pass the batch as a tensor with the batch dimension first."
    )


def slice_batch(batch: Any, batch_size: int, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor or sequence in ``batch`` whose first dimension is ``batch_size``."""
    if isinstance(batch, torch.Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == batch_size else batch
    if isinstance(batch, dict):
        return type(batch)((k, slice_batch(v, batch_size, start, stop)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(slice_batch(v, batch_size, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        if len(batch) == batch_size and not any(isinstance(v, (torch.Tensor, list, tuple, dict)) for v in batch):
            return batch[start:stop]
        return type(batch)(slice_batch(v, batch_size, start, stop) for v in batch)
    return batch
