"""Passes of model calls that run only some of the backbone's containers.

[Note: partial passes] An encoder-decoder's ``generate()`` calls the encoder on its own once (``get_encoder()(...)``),
then the whole model per token with the encoder's output given (``encoder_outputs=``), which runs the decoder's
blocks only. A model call that runs some of the backbone's containers is a pass too, over every stage:

- **Which blocks.** The call runs on ghosts up to its first block
  (:meth:`~lightning_pipe._calls.runners.BlockRunners.first_call_of`), which must start a container; the first time a
  (module, first block) is met, a *census* runs it on ghosts with every block skipped
  (:meth:`~lightning_pipe._step.program.StepProgram.census`): the blocks it calls (whole containers, in order) and
  the outputs of the modules that produce the values the stages carry ([Note: stage boundaries]). A module's calls
  count from the first block's region (T5's shared embedding is the decoder's second call in training and its
  first here).
- **What crosses.** The training flow, restricted to what the call produces, as far as its uses within the call
  (:func:`~lightning_pipe._calls.flow.make_pass_flow`): the encoder's output, an input of the decoder's calls on
  every rank, crosses nothing. The code after the call's last block runs on the *answer stage*, the stage that holds
  that code's parameters: the stage where the next container starts (the encoder's final norm), or the last.
- **The other stages.** A stage with none of the call's blocks, before them or after the answer stage, passes on what
  it received (the row numbers when nothing: torch's schedule sends every stage's output). The answer stage keeps
  its microbatches' outputs when it is not the last, and answers from them after the schedule; its answer goes to
  every rank from there (:meth:`~lightning_pipe._step.generation.LockStep._share`). Each kind of call has a schedule
  of its own (its stages send other shapes); so has each cache length when a boundary carries more than the hidden
  state (T5's decoder sends its position bias, as wide as the cache plus the new token, in calls of one shape).
- **The caches.** An ``EncoderDecoderCache`` splits as two caches (self- and cross-attention), each microbatch with
  its own ``is_updated`` flags; the cache's layer 0 is the decoder's first block ([Note: caches per microbatch]).
- **An encoder outside the backbone** (``backbone=`` Florence2's decoder's layers only; the encoder runs before
  them on the first stage): a call of what the model's ``get_encoder()`` returns runs on the stage that holds it, and
  its output goes to every rank; the decoder's calls then carry no encoder output between stages. So does a call of
  the model's input embeddings outside a pass: Florence2's ``generate()`` embeds the prompt itself and gives the
  pipelined encoder those ``inputs_embeds``, which the other stages would hold as ghosts; and so does a
  vision-language model's ``get_image_features`` (``get_video_features``), which ``generate()`` calls once before
  its first model call: the prefill pass then cuts the features per microbatch (``_step/pass_inputs.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from lightning_pipe._calls.flow import Flow, make_pass_flow
from lightning_pipe._errors import BackboneCallError

if TYPE_CHECKING:
    from lightning_pipe._model.cut import Cut
    from lightning_pipe._step.pass_inputs import PassInputs


class PartialPasses:
    """What the passes of one runtime's calls that run only some blocks carry (see [Note: partial passes]).

    Args:
        runtime: the ``PipelineRuntime``.
        prefixes: the paths of the path modules (the modules on the way to the backbone's containers).
        path_modules: those modules.
    """

    def __init__(self, runtime: Any, prefixes: set[str], path_modules: list[nn.Module]) -> None:
        self.runtime = runtime
        paths = runtime.cut.backbone.paths
        #: the path modules that hold only some of the backbone's containers (an encoder-decoder's encoder), by id
        self.modules = {
            id(runtime.module.get_submodule(p)) for p in prefixes if p and not all(c.startswith(p + ".") for c in paths)
        }
        self.flows: dict[tuple[int, int], Optional[Flow]] = {}  # (id(module), first block) -> its pass's flow
        #: ``{id: (path, encoder, the stages that hold all its parameters)}``
        self.outside = outside_encoders(runtime.module, runtime.cut, path_modules)
        #: the same of the path modules' input embeddings, which ``generate()`` may call on its own (Florence2 embeds
        #: the prompt before it calls the pipelined encoder with ``inputs_embeds``)
        self.outside_inputs = outside_embeddings(runtime.module, runtime.cut, path_modules)
        #: ``(path, model, method, stages)`` of the vision-language models' feature methods that ``generate()`` calls
        #: on its own (``get_image_features``)
        self.outside_features = outside_features(runtime.module, runtime.cut, path_modules)
        self.outside_called = False  # whether a step called one (the decoder's calls are then given its output)

    def flow_of(self, module: nn.Module, call: Callable[..., Any], first: int, inputs: PassInputs) -> Optional[Flow]:
        """What the stages carry in a call of ``module`` whose first block is ``first``: ``None`` for a call of the
        whole backbone, else the flow of the blocks it runs ([Note: partial passes]); learnt at its first call."""
        backbone = self.runtime.cut.backbone
        whole = first == 0 and id(module) not in self.modules
        if whole and not self.outside_called:
            return None
        key = (id(module), first)
        if key not in self.flows:
            blocks = backbone.blocks
            if first > 0 and blocks[first].container == blocks[first - 1].container:
                raise BackboneCallError(
                    f"A decoding step's model call started at block `{blocks[first].name}`, inside the container"
                    f" `{backbone.paths[blocks[first].container]}`. Under `PipelineStrategy` a model call runs the"
                    " backbone from its first block, or from the first block of one of its containers (an"
                    " encoder-decoder's decoder): call the model the same way in every decoding step."
                )
            program = self.runtime.program
            try:
                called, produced = program.census(call, first, inputs.lp_rows(0, inputs.batch_size, "ghost"))
            except Exception:
                if not whole:
                    raise
                called, produced = list(range(len(blocks))), {p[:3] for p in self.runtime.cut.structure.values}
            stop = called[-1] + 1
            if stop < len(blocks) and blocks[stop].container == blocks[stop - 1].container:
                raise BackboneCallError(
                    f"A decoding step's model call ran the backbone from block `{blocks[first].name}` to"
                    f" `{blocks[stop - 1].name}` only, inside the container `{backbone.paths[blocks[stop].container]}`."
                    " Under `PipelineStrategy` a model call runs whole containers of blocks (an encoder-decoder's"
                    " encoder, then its decoder)."
                )
            structure = self.runtime.cut.structure
            produced |= {("block", j, 0) for j in range(first, stop)}
            produced |= {p[:3] for p, (position, _) in structure.values.items()
                         if p[0] == "inner" and first <= (position - 1) // 2 < stop}
            everything = stop == len(blocks) and all(p[:3] in produced or p in produced for p in structure.values)
            self.flows[key] = None if whole and everything else make_pass_flow(
                structure, self.runtime.layout, [b.name for b in blocks], range(first, stop), produced
            )
        return self.flows[key]


def outside_embeddings(
    root: nn.Module, cut: Cut, path_modules: list[nn.Module]
) -> dict[int, tuple[str, nn.Module, frozenset[int]]]:
    """The input embeddings of the path modules (``get_input_embeddings()``), outside the backbone: a call of one
    outside a pass (``generate()`` embedding the prompt itself) runs on a stage that holds it, and its output goes to
    every rank, as an outside encoder's does. ``{id: (path, embedding, the stages that hold all its parameters)}``."""
    found: dict[int, tuple[str, nn.Module, frozenset[int]]] = {}
    names = {id(m): name for name, m in root.named_modules()}
    for module in path_modules:
        try:
            embedding = module.get_input_embeddings()  # type: ignore[operator]
        except Exception:
            continue
        if isinstance(embedding, nn.Module) and id(embedding) not in found:
            held = _held_by(cut, embedding)
            if held:
                found[id(embedding)] = (names.get(id(embedding), type(embedding).__name__), embedding, held)
    return found


FEATURE_METHODS = ("get_image_features", "get_video_features")


def outside_features(
    root: nn.Module, cut: Cut, path_modules: list[nn.Module]
) -> list[tuple[str, nn.Module, str, frozenset[int]]]:
    """A vision-language model's feature methods (``get_image_features``, ``get_video_features``) on the path
    modules, which ``generate()`` calls before its first model call to encode the images once: each runs on a stage
    that holds all the parameters of the model's parts outside the language model (its vision tower and projector),
    and its output goes to every rank. ``[(path.method, model, method, stages)]``; none where those parts are split
    over stages."""
    found: list[tuple[str, nn.Module, str, frozenset[int]]] = []
    names = {id(m): name for name, m in root.named_modules()}
    blocks = {id(cut.backbone.module(i)) for i in range(len(cut.backbone))}
    for module in path_modules:
        methods = [m for m in FEATURE_METHODS if callable(getattr(type(module), m, None))]
        if not methods:
            continue
        parts = [c for c in module.children() if not {id(m) for m in c.modules()} & blocks]
        held = [h for h in (_held_by(cut, part) for part in parts) if h is not None]  # by the cut: the same everywhere
        if not held:
            continue
        stages = frozenset.intersection(*held)
        if stages:
            found += [(f"{names.get(id(module), type(module).__name__)}.{m}", module, m, stages) for m in methods]
    return found


def _held_by(cut: Cut, module: nn.Module) -> Optional[frozenset[int]]:
    """The stages that hold all of ``module``'s parameters, where it is outside the backbone and has some."""
    inside = {id(m) for m in module.modules()}
    if inside & {id(cut.backbone.module(i)) for i in range(len(cut.backbone))}:
        return None
    held = [r.stages for r in cut.registrations if r.kind == "parameter" and id(r.owner) in inside]
    return frozenset.intersection(*held) if held else None


def outside_encoders(
    root: nn.Module, cut: Cut, path_modules: list[nn.Module]
) -> dict[int, tuple[str, nn.Module, frozenset[int]]]:
    """The encoders outside the backbone that ``generate()`` calls on its own: what an encoder-decoder path module's
    ``get_encoder()`` returns when the backbone holds none of it (Florence2's language encoder runs before the
    pipelined decoder, on the first stage). ``{id: (path, encoder, the stages that hold all its parameters)}``."""
    found: dict[int, tuple[str, nn.Module, frozenset[int]]] = {}
    paths = {id(m) for m in path_modules}
    names = {id(m): name for name, m in root.named_modules()}
    blocks = {id(cut.backbone.module(i)) for i in range(len(cut.backbone))}
    for module in path_modules:
        if not getattr(getattr(module, "config", None), "is_encoder_decoder", False):
            continue
        try:
            encoder = module.get_encoder()
        except Exception:
            continue
        if not isinstance(encoder, nn.Module) or id(encoder) in paths or id(encoder) in found:
            continue
        inside = {id(m) for m in encoder.modules()}
        if inside & blocks:
            continue
        held = [r.stages for r in cut.registrations if r.kind == "parameter" and id(r.owner) in inside]
        if held:
            name = names.get(id(encoder), type(encoder).__name__)
            found[id(encoder)] = (name, encoder, frozenset.intersection(*held))
    return found
