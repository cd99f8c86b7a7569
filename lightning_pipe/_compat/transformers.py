"""Hugging Face ``transformers``' output capturing, installed before the pipeline swaps the blocks out.

``transformers`` (5.x, checked against 5.24) records extra outputs (router logits, attentions, hidden states) with
forward hooks that ``capture_outputs`` installs lazily, at a model's first forward that records one, on the modules
that ``named_children`` reaches then, and marks the model done (``_output_capturing_hooks_installed``). While a
pipelined step runs, the backbone's containers hold runners instead of the blocks (``_calls/runners.py``), so a lazy
install would miss every block and never be retried. :func:`install_output_capturing` does it first, as the
outermost model's first forward would, before the setup's run of the step, and undoes it when no value leaves a
block through these hooks (a model that records nothing keeps running without them). ``transformers`` is not a
dependency: nothing is imported that the user's code has not imported.
"""

from __future__ import annotations

import sys
from typing import Callable

from torch import nn

_INSTALLED = "_output_capturing_hooks_installed"  # the mark transformers sets on a model whose hooks are installed


def install_output_capturing(module: nn.Module) -> Callable[[], None]:
    """Install ``transformers``' output-capturing hooks on every Hugging Face model in ``module`` that has none yet,
    outermost first (installing a model installs the models inside it; a model whose inner model already has its
    hooks is left alone, which would install those twice). The hooks record only while a forward asks.

    Returns what undoes it: the setup keeps them only where a value leaves a block through one."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    modeling = sys.modules.get("transformers.modeling_utils")
    install = getattr(capturing, "maybe_install_capturing_hooks", None)
    pretrained = getattr(modeling, "PreTrainedModel", None)
    if install is None or pretrained is None:
        return lambda: None
    before = {id(m): set(m._forward_hooks) for m in module.modules()}
    marked = []
    for model in module.modules():
        if not isinstance(model, pretrained):
            continue
        inside = [m for m in model.modules() if isinstance(m, pretrained)]
        if not any(getattr(m, _INSTALLED, False) for m in inside):
            install(model)
            marked += inside

    def undo() -> None:
        for m in module.modules():
            for key in set(m._forward_hooks) - before.get(id(m), set()):
                m._forward_hooks.pop(key, None)
                m._forward_hooks_with_kwargs.pop(key, None)
                m._forward_hooks_always_called.pop(key, None)
        for m in marked:
            setattr(m, _INSTALLED, False)

    return undo
