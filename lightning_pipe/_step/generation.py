"""Generation through the pipeline: evaluation steps that call the model once per decoding step.

[Note: lock step] A ``validation_step``, ``test_step`` or ``predict_step`` that generates (``model.generate()``,
nanoGPT's sampling loop, a hand-written beam search) calls the backbone once per new token, and what it feeds the
next call (the chosen tokens, the beams, whether to stop) is decided from what the last stage computed. Such a step
runs on every rank of the pipeline at once, as a whole, on the real batch:

- **The pass.** The loop calls a module whose forward runs the backbone (the Hugging Face model, nanoGPT's ``GPT``,
  the LightningModule through ``self(...)``): the outermost *path module* (the LightningModule and the modules on
  the way to the backbone's containers) in progress when the backbone is reached. That call is a *pass*. Every rank
  runs it through torch's forward-only schedule (:meth:`LockStep._pass`): its inputs are split into microbatches by
  rows, each stage runs the forward on its own blocks as in any evaluation step (:mod:`lightning_pipe._step.program`),
  and the last stage runs the code after the backbone (final norm, head) on the merged output of its blocks.
- **The answer.** The last stage sends what the forward returned (the logits, a ``ModelOutput``) to every rank of the
  pipeline, and every rank returns it from the call (:meth:`LockStep._share`). So every rank runs the same Python
  control flow on the same real values: ``argmax``, logits processors, stopping criteria, beam indices, sampling. A
  value the next pass depends on is never a stand-in.
- **The random state** is the last stage's on every rank when the step starts: sampling draws the same tokens
  everywhere.
- **Caches** are split per microbatch, each stage keeping its own layers' entries ([Note: caches per microbatch] in
  :mod:`lightning_pipe._step.caches`); ``get_seq_length`` answers the same on every stage.
- **Logs and metrics** are computed on every rank from the same values, so every rank logs what one device logs.

Calls that run only some of the backbone's containers (an encoder-decoder's encoder, then its decoder per token) are
passes too: [Note: partial passes] in :mod:`lightning_pipe._step.partial`.

A step is known to generate once its first batch called the backbone a second time: on the last stage that is the
:class:`~lightning_pipe._calls.stops.SecondPass` the single-pass evaluation meets; every rank learns it from the
last stage, the random state is put back, and the batch runs again in lock step. A step whose first model call's
rows are not the batch's (beam search: each prompt made into its beams before that call) runs in lock step at once
(:meth:`LockStep.splits_by_rows`). Later batches of that step run in lock step from the start.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional, ParamSpec, TypeVar, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import TreeSpec, tree_leaves

from lightning_pipe import _watchdog
from lightning_pipe._calls.batch import rows_dim
from lightning_pipe._compat.torch import Swaps
from lightning_pipe._errors import BackboneCallError
from lightning_pipe._ghost import GhostValueError, contains_ghost
from lightning_pipe._step.answers import Failed, describe_answer, rebuild_answer
from lightning_pipe._step.caches import BlockStates, PassCaches, is_cache
from lightning_pipe._step.partial import PartialPasses
from lightning_pipe._step.pass_inputs import PassInputs, call_with, check_caches, check_no_ghosts, pass_kind
from lightning_pipe._step.random_state import random_state_of, set_random_state

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Generates:
    """What the last stage answers for a batch whose step turned out to generate (:class:`SecondPass`)."""


@dataclass(frozen=True)
class StepFailed:
    """What the last stage answers for an evaluation batch whose step raised there: it raises its own error, every
    other rank of the pipeline a :class:`BackboneCallError` with this message, which names it."""

    message: str

    @classmethod
    def of(cls, err: BaseException, rank: int, step: Callable[..., object]) -> StepFailed:
        return cls(f"The last pipeline stage (pipeline rank {rank}) failed in `{_name(step)}`: {type(err).__name__}:"
                   f" {err}")


class LockStep:
    """The lock-step evaluation steps of one runtime (see [Note: lock step])."""

    def __init__(self, runtime: Any) -> None:  # the PipelineRuntime (which imports this module)
        self.runtime = runtime
        self.steps: set[str] = set()  # names of the steps known to generate
        self._rows_checked: set[str] = set()  # steps whose calls' rows are the batch's (`splits_by_rows`)
        backbone = runtime.cut.backbone
        self.caches = PassCaches(len(backbone), window=self._window)
        local = {i for first, stop in runtime.program.stage_bounds.values() for i in range(first, stop)}
        self.states = BlockStates(
            [backbone.module(i) for i in sorted(local)],
            [backbone.module(i) for i in range(len(backbone)) if i not in local],
            list(runtime.module.buffers()),
        )
        self.passes = 0  # model calls run through the pipeline on this rank (the generation benchmark reads it)
        self._in_pass = False
        prefixes = {".".join(p.split(".")[:i]) for p in backbone.paths for i in range(len(p.split(".")))}
        self._path_modules = [runtime.module.get_submodule(p) for p in sorted(prefixes, key=len)]
        self.partial = PartialPasses(runtime, prefixes, self._path_modules)  # [Note: partial passes]

    def _window(self) -> Optional[range]:
        """The blocks the stage run in progress runs (a microbatch's cache gives it their cache layers as they are)."""
        run = self.runtime.program.current
        first, stop = getattr(run, "first", None), getattr(run, "stop", None)
        return range(first, stop) if isinstance(first, int) and isinstance(stop, int) else None

    def generates(self, step: Callable[..., object]) -> bool:
        return _name(step) in self.steps

    def learn(self, step: Callable[..., object]) -> None:
        self.steps.add(_name(step))

    def splits_by_rows(self, step: Callable[..., object], batch_size: int, num_microbatches: int, *args: Any,
                       **kwargs: Any) -> bool:
        """Whether the single-pass evaluation may run ``step``, whose first model call has ``batch_size`` rows: each
        microbatch's rows of the batch give that call's rows ``start:stop``, of the same shape as the whole call's.

        Beam search does not: ``generate(num_beams=2)`` makes 16 rows of 8 prompts before its first model call, so
        no tensor of the batch is cut and every microbatch would run all of it. Nor does code that pads to the
        longest of the rows it is given (left-padded prompts made in the step): a microbatch's call is narrower than
        the whole batch's, and the code after the backbone, which runs on the whole batch, would meet the
        microbatches' outputs. Such a step runs in lock step, which cuts the calls' own inputs. Checked on ghosts (the
        code up to the first block) once per step, on every rank.
        """
        if num_microbatches == 1 or _name(step) in self._rows_checked:
            return True
        program = self.runtime.program
        rows = batch_size // num_microbatches
        whole = program.hidden_shape_of(step, *args, **kwargs)
        expected = list(whole)
        expected[rows_dim(whole, args[:1])] = rows  # [Note: sequence-first hidden states]
        for start in range(0, batch_size, rows):
            part = program.batch_rows(args[0], batch_size, start, start + rows)
            if program.hidden_shape_of(step, part, *args[1:], **kwargs) != tuple(expected):
                return False
        self._rows_checked.add(_name(step))
        return True

    def run(self, step: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        """The whole step on this rank, its passes through the pipeline; returns what the step returns."""
        self._sync_random_state()
        try:
            with self._path_calls_intercepted():
                result = step(*args, **kwargs)
        except GhostValueError as err:
            raise BackboneCallError(
                f"`{_name(step)}` generates, so it runs on every pipeline rank, but it read a value this rank does not"
                f" compute ({err}). Between decoding steps the loop may only use what the model call returns: call"
                " the module whose forward runs the whole model, embedding to head (`self.model.generate(...)`,"
                " `self(...)`), instead of the backbone or its blocks directly."
            ) from err
        finally:
            self.caches.release()
        if contains_ghost(result):
            raise BackboneCallError(
                f"`{_name(step)}` returns values this pipeline rank does not compute; return values computed from the"
                " model calls' outputs and the batch."
            )
        return result

    # ------------------------------------------------------------------------------------------------ the passes
    @contextmanager
    def _path_calls_intercepted(self) -> Iterator[None]:
        """Route the calls of the path modules through :meth:`_pass` while the step runs."""
        with Swaps() as swaps:
            for module in self._path_modules:
                swaps.wrap(module, "forward", functools.partial(self._intercepting, module))
            for path, module, stages in self.partial.outside.values():
                swaps.wrap(module, "forward", lambda forward, p=path, s=stages: self._run_where_held(p, forward, s))
            for path, module, stages in self.partial.outside_inputs.values():
                swaps.wrap(module, "forward",
                           lambda forward, p=path, s=stages: self._run_where_held(p, forward, s, encoder=False))
            for path, module, method, stages in self.partial.outside_features:
                swaps.wrap(module, method,
                           lambda forward, p=path, s=stages: self._run_where_held(p, forward, s, encoder=False))
            guard = self.runtime.cut.backbone.module(0).register_forward_pre_hook(self._outside_a_pass)
            try:
                yield
            finally:
                guard.remove()

    def _outside_a_pass(self, block: nn.Module, args: tuple) -> None:
        if not self._in_pass:
            first = self.runtime.cut.backbone.blocks[0].name
            raise BackboneCallError(
                f"A step that generates called the backbone's first block (`{first}`) itself. Under"
                " `PipelineStrategy` each decoding step must call the model, the module whose forward runs the"
                " backbone (`self.model(...)`, `self.model.generate(...)`, `self(...)`): that call runs through the"
                " pipeline, and its result reaches every rank."
            )

    def _intercepting(self, module: nn.Module, forward: Callable[_P, _R]) -> Callable[_P, _R]:
        # `wraps` keeps the signature: `generate()` reads it (it passes `position_ids` to a forward that takes them)
        @functools.wraps(forward)
        def intercepted(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if self._in_pass or self.runtime.program.current is not None:
                return forward(*args, **kwargs)  # inside a pass: the stage's own run
            self._in_pass = True
            self.passes += 1
            try:
                return self._pass(module, args, kwargs)
            finally:
                self._in_pass = False

        return intercepted

    def _run_where_held(
        self, path: str, forward: Callable[_P, _R], stages: frozenset[int], encoder: bool = True
    ) -> Callable[_P, _R]:
        """A call, outside a pass, of an encoder outside the backbone (:func:`~lightning_pipe._step.partial.
        outside_encoders`) or of the input embeddings (``encoder=False``, :func:`~lightning_pipe._step.partial.
        outside_embeddings`): run on the first stage that holds all of its parameters, its result sent to every rank
        of the pipeline."""

        @functools.wraps(forward)
        def intercepted(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if self._in_pass or self.runtime.program.current is not None:
                return forward(*args, **kwargs)
            if not stages:
                raise BackboneCallError(
                    f"A decoding step called `{path}` (the model's encoder, outside the pipelined backbone) on its"
                    " own, but its parameters are split over several stages. Pipeline its layers too (`backbone=`"
                    " the encoder's and the decoder's containers, in the order they run)."
                )
            if encoder:
                self.partial.outside_called = True
            stage = min(stages)
            answer: object = None
            failed = None
            if self.runtime.pipeline.pipeline_rank == self.runtime.layout.stage_rank(stage):
                try:
                    answer = forward(*args, **kwargs)
                except Exception as err:  # every rank raises it, instead of waiting for the answer
                    failed, answer = err, Failed(f"{type(err).__name__}: {err}")
            result = self._share(answer, (args, kwargs), stage)
            if failed is not None:
                raise failed
            return result

        return intercepted

    def _pass(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """One call of ``module`` through the pipeline; returns the answer stage's result on every rank."""
        runtime = self.runtime
        program, pipeline = runtime.program, runtime.pipeline
        call = functools.partial(call_with, module)
        check_caches(args, kwargs)
        check_no_ghosts(module, args, kwargs)
        first, shape = program.first_call_of(call, (args, kwargs))
        batch_size = program.rows_of(shape, (args, kwargs))
        if program.rows_per_row != 1:
            raise BackboneCallError(
                f"A generation pass's first backbone block gets a hidden state of {batch_size} rows,"
                f" {program.rows_per_row} for each row of the call's inputs (frames or images folded into the batch)."
                " `PipelineStrategy` cuts a generation pass by its inputs' rows, which it cannot do here. Set"
                " `backbone=` to the blocks whose hidden state holds one row per row of the inputs (a vision-language"
                " model's language layers)."
            )
        num_microbatches = runtime.microbatches.for_batch(batch_size)
        inputs = PassInputs(module, args, kwargs, batch_size, self.caches, states=self.states)
        for value in (*args, *kwargs.values()):
            if is_cache(value):  # on every rank, also where no stage runs this call's blocks
                self.caches.adopt(value)
        flow = self.partial.flow_of(module, call, first, inputs)
        blocks = flow.blocks if flow is not None else range(len(runtime.cut.backbone))
        last = runtime.layout.num_stages - 1
        answer_stage = last if flow is None else flow.answer_stage % (last + 1)
        answering = pipeline.pipeline_rank == runtime.layout.stage_rank(answer_stage)
        self.caches.begin_pass(blocks)
        self.states.begin(batch_size)
        answer: object = None
        failed = None
        with program.passing(flow) if flow is not None else nullcontext():
            try:
                with program.holding(call, inputs, batch_size):
                    sample = program.sub_batch(torch.arange(batch_size // num_microbatches))
                    output = pipeline.eval_step(sample, batch_size, num_microbatches, rows_dim=program.rows_dim,
                                                kind=pass_kind(flow, inputs))
            finally:
                self.states.end()
            if answering:
                try:
                    if answer_stage != last:
                        output = program.kept_answers(batch_size)
                    answer = program.run_answering(output, call, (args, kwargs))
                except Exception as err:  # every rank raises it, instead of waiting for the answer
                    failed = err
                    answer = Failed(f"{type(err).__name__}: {err}")
        result = self._share(answer, (args, kwargs), answer_stage)
        if failed is not None:
            raise failed
        self.caches.mirror()
        return result

    def _share(self, answer: object, inputs: tuple[tuple, dict], stage: int) -> Any:
        """The ``answer`` of ``stage`` (the last, or the answer stage of a partial pass) on every rank of the
        pipeline: its tensors broadcast, the objects it passed through from the call's inputs (a cache) taken from
        this rank's own inputs."""
        runtime = self.runtime
        group, src, device = runtime.pipeline.group, runtime.layout.stage_rank(stage), runtime.device
        mine = runtime.pipeline.pipeline_rank == src
        input_leaves = tree_leaves(inputs)
        header: list[Optional[tuple[Union[TreeSpec, Failed], list[tuple]]]] = [None]
        tensors: list[Tensor] = []
        if mine:
            header[0], tensors = describe_answer(answer, input_leaves)
        if runtime.layout.pipeline_size == 1:
            return None if isinstance(answer, Failed) else rebuild_answer(*header[0], tensors, input_leaves, device)
        what = f"the model's output from stage {stage} (pipeline rank {src}), in a decoding step"
        with _watchdog.waiting(lambda: what):
            dist.broadcast_object_list(header, group_src=src, group=group)
            spec, kinds = header[0]
            if isinstance(spec, Failed):  # the answering stage raises its own error, the others this one
                if not mine and stage != runtime.layout.num_stages - 1:
                    raise BackboneCallError(
                        f"Pipeline stage {stage} (pipeline rank {src}) failed in a generation pass: {spec.message}"
                    )
                return None if mine else rebuild_answer(spec, kinds, [], input_leaves, device)
            received = []
            for kind in kinds:
                if kind[0] != "tensor":
                    continue
                if mine:
                    buffer = tensors[len(received)]
                else:
                    buffer = torch.empty(kind[1], dtype=kind[2], device=device)
                dist.broadcast(buffer, group_src=src, group=group)
                received.append(buffer)
        return rebuild_answer(spec, kinds, received, input_leaves, device)

    def _sync_random_state(self) -> None:
        """Every rank of the pipeline takes the last stage's random state (sampling draws the same tokens)."""
        runtime = self.runtime
        if runtime.layout.pipeline_size == 1:
            return
        device = runtime.device
        states = random_state_of(device)
        group, src = runtime.pipeline.group, runtime.pipeline.last_stage_rank
        with _watchdog.waiting(lambda: f"the random state of the last stage (pipeline rank {src})"):
            for i, state in enumerate(states):
                moved = state.to(device)
                dist.broadcast(moved, group_src=src, group=group)
                states[i] = moved.cpu()
        set_random_state(states, device)


def _name(step: Callable[..., object]) -> str:
    return getattr(step, "__name__", repr(step))
