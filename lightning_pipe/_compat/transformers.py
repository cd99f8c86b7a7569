"""Hugging Face ``transformers``' output capturing, installed before the pipeline swaps the blocks out,
and what it records of the blocks' own outputs.

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
from typing import Callable, Optional

from torch import Tensor, nn

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


def recorded_outputs() -> Optional[dict]:
    """What ``transformers`` is recording now (``{"hidden_states": [...], ...}``: the collector a ``capture_outputs``
    forward opened, which the hooks append to), or None.

    A step that asks a model for its layers' hidden states (``output_hidden_states=True``, or LLaVA's vision tower
    asked for ``hidden_states[vision_feature_layer]``) gets them from hooks on the blocks themselves. A pipeline stage
    skips the blocks of the other stages, whose hooks then record nothing: the setup's analysis looks here to find the
    blocks whose own outputs are recorded, and keeps them out of the pipeline (``_model/split.py``)."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    return collector.get() if collector is not None else None


def newly_recorded(before: Optional[dict[str, int]], value: object) -> bool:
    """Whether ``value`` was appended to what :func:`recorded_outputs` records since it held ``before`` (``{key: its
    length}``)."""
    collected = recorded_outputs()
    if before is None or not collected:
        return False
    return any(
        any(item is value for item in entries[before.get(key, 0):])
        for key, entries in collected.items() if isinstance(entries, list)
    )


def recording_lengths() -> Optional[dict[str, int]]:
    """``{key: length}`` of what :func:`recorded_outputs` records now, or None when nothing is recorded."""
    collected = recorded_outputs()
    if not collected:
        return None
    return {key: len(entries) for key, entries in collected.items() if isinstance(entries, list)}


def encoded_media_rows(encoded: dict, ids: Tensor, config: object, start: int, stop: int) -> Optional[dict]:
    """The features ``generate()`` encoded for a batch's images and videos (``mm_encoder_outputs``: one feature row
    per placeholder token, in placeholder order over the rows) that fill the placeholders of rows ``start:stop`` of
    ``ids``, as ``generate()``'s own chunked prefill cuts them (``_slice_mm_encoder_output``); None where this
    release has no such cut, or a modality's placeholder token is unknown."""
    utils = sys.modules.get("transformers.generation.utils")
    cut = getattr(utils, "_slice_mm_encoder_output", None)
    if cut is None:
        return None
    kept = {}
    for modality, output in encoded.items():
        token = getattr(config, f"{modality}_token_id", None)
        if output is None:
            kept[modality] = output
            continue
        if not isinstance(token, int):
            return None
        mask = ids == token
        rows = (mask.flatten().cumsum(0).view_as(mask) - 1)[start:stop][mask[start:stop]]
        if rows.numel():
            kept[modality] = cut(output, rows)
    return kept

