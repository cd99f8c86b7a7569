"""Zoo models (tests/zoo.py) trained as their own script, so Lightning's launcher can start the other ranks from it.

Usage: ``python tests/zoo_job.py SPEC.json OUT_DIR``. The spec holds ``devices`` and a list of ``phases``, run one
after the other in the same processes (starting processes costs more than a small fit). A phase:

- ``name``: where its results go (``OUT_DIR/<name>.rank<r>.pt``);
- ``model``: a key of ``zoo.ZOO`` or ``zoo_layouts.MODELS``, with ``model_kwargs``; ``meta_init``: build it on the
  meta device (without a strategy it is then materialised with ``lightning_pipe.materialize``, as the pipeline
  materialises its stages);
- ``strategy``: ``PipelineStrategy`` kwargs, or null for the single-device reference; ``trainer``: Trainer kwargs;
- ``data``: kwargs of ``zoo_layouts.loader``; ``fns``: ``fit``, ``validate`` and/or ``predict`` (default
  ``["fit"]``);
- ``save``: a path to ``trainer.save_checkpoint`` after the fns; ``ckpt_path``: for ``fit``;
- ``count_deferred``: count the linear weight gradients the schedule's weight actions compute ([Note: deferred
  weight gradients]), recorded as ``deferred``, with the warnings the phase's calls gave (``warnings``);
- ``expect_error``: the phase must raise; its message is recorded. An unexpected error is recorded too (the rank's
  ``OUT_DIR/<name>.rank<r>.pt`` holds its traceback) and then stops the launch: its ranks may be out of step.

Every rank records the losses and learning rates of every step, its state dict before and after training, the
callback metrics, predictions and validation values, and, for parameters with several names on this rank (a tied
head), whether the names still hold the same tensor, and the sequence lengths its blocks were given (blocks that
keep ``input_lengths``). :func:`run_phase` runs one phase in the calling process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelSummary
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zoo_layouts
from helpers import plain, state_after_call

from lightning_pipe import PipelineStrategy


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.initial: Optional[dict[str, torch.Tensor]] = None
        self.val: list[float] = []
        self.local_numel: Optional[int] = None  # what this rank holds while training (after a call: the whole model)

    def on_train_end(self, trainer, pl_module):
        self.local_numel = local_numel(pl_module)

    def on_train_start(self, trainer, pl_module):
        if self.initial is None:
            self.initial = plain(pl_module.state_dict())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({
            "train_loss": float(trainer.callback_metrics["train_loss"]),
            "returned_loss": float(outputs["loss"]),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        })

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and "val_loss" in trainer.callback_metrics:
            self.val.append(float(trainer.callback_metrics["val_loss"]))


def local_numel(model: torch.nn.Module) -> int:
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())


def run_phase(phase: dict[str, Any], devices: int) -> dict[str, Any]:
    kwargs = phase.get("model_kwargs", {})
    if phase.get("meta_init"):
        with torch.device("meta"):
            model = zoo_layouts.make(phase["model"], **kwargs)
        if phase.get("strategy") is None:  # the reference: the whole model materialised as the pipeline does
            from lightning_pipe import materialize

            materialize(model, torch.device("cpu"))
    else:
        model = zoo_layouts.make(phase["model"], **kwargs)
    recorder = Recorder()
    trainer_kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[recorder],
        max_epochs=1,
    )
    if phase.get("strategy") is not None:
        trainer_kwargs["strategy"] = PipelineStrategy(**phase["strategy"])
    elif "strategy_name" in phase:
        trainer_kwargs["strategy"] = phase["strategy_name"]
    trainer_kwargs.update(phase.get("trainer", {}))
    trainer = L.Trainer(**trainer_kwargs)
    data = phase.get("data", {})
    train = zoo_layouts.loader(phase["model"], **data)
    val = zoo_layouts.loader(phase["model"], **{**data, "seed": 1})
    result: dict[str, Any] = {"error": None, "predictions": None, "deferred": None}
    applied: list[int] = []
    if phase.get("count_deferred"):
        from lightning_pipe._step import deferred_linear

        apply = deferred_linear._apply
        deferred_linear._apply = lambda collected: (applied.append(len(collected)), apply(collected))[1]
    counting = phase.get("count_deferred")
    with warnings.catch_warnings(record=True) if counting else contextlib.nullcontext() as given:
        if counting:  # what the phase's calls warn
            warnings.simplefilter("always")
        try:
            for fn in phase.get("fns", ["fit"]):
                if fn == "fit":
                    val_in_fit = val if phase.get("validate_in_fit") else None
                    trainer.fit(model, train, val_in_fit, ckpt_path=phase.get("ckpt_path"))
                elif fn == "validate":
                    result["validated"] = trainer.validate(model, val, verbose=False)
                elif fn == "predict":
                    result["predictions"] = [p.cpu() for p in trainer.predict(model, val)]
            if "save" in phase:
                trainer.save_checkpoint(phase["save"])
            if "hf_save" in phase and isinstance(trainer.strategy, PipelineStrategy):  # not by the one-process one
                trainer.strategy.save_pretrained(Path(phase["hf_save"]) / "parallel")  # after the call: in parallel,
                if trainer.is_global_zero:  # and the user's line on global zero
                    model.model.save_pretrained(Path(phase["hf_save"]) / "plain")
        except Exception as err:
            if not phase.get("expect_error"):
                raise
            result["error"] = "".join(traceback.format_exception_only(type(err), err))
        finally:
            if phase.get("count_deferred"):
                deferred_linear._apply = apply
                result["deferred"] = sum(applied)
    if counting:
        result["warnings"] = [str(w.message) for w in given]
    pipelined = isinstance(trainer.strategy, PipelineStrategy)
    summaries = [cb for cb in trainer.callbacks if isinstance(cb, ModelSummary)]
    if summaries:  # what the summary reports as the model's size (computed on every rank alike)
        result["summary_total"] = summaries[0]._summary(trainer, model).total_parameters
    state = state_after_call(model, keep_vars=True)
    tied = {}
    for key, value in state.items():
        for other, value2 in state.items():
            if key < other and value is value2:
                tied[f"{key}={other}"] = True
    result.update(
        steps=recorder.steps,
        val=recorder.val,
        initial=recorder.initial,
        state_dict=plain(state),
        local_numel=recorder.local_numel if recorder.local_numel is not None else local_numel(model),
        tied=tied,
        input_lengths=sorted({n for m in model.modules() for n in getattr(m, "input_lengths", ())}),
        callback_metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
        global_step=trainer.global_step,
        rank=trainer.global_rank,
        layout=[list(b) for b in trainer.strategy.layout.bounds] if pipelined and result["error"] is None else None,
    )
    return result


def main(spec_file: str, out_dir: str, run: Callable[[dict[str, Any], int], dict[str, Any]] = run_phase) -> None:
    """Run every phase of the spec with ``run`` (``run_phase``, or another job's), each rank saving its results."""
    spec = json.loads(Path(spec_file).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for phase in spec["phases"]:
        try:
            result = run(phase, spec["devices"])
        except BaseException:
            started = torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if started else int(os.environ.get("LOCAL_RANK", 0))
            torch.save({"error": traceback.format_exc(), "rank": rank}, out / f"{phase['name']}.rank{rank}.pt")
            raise
        torch.save(result, out / f"{phase['name']}.rank{result['rank']}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
