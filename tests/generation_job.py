"""Generation models (tests/generation_models.py) trained and scored as their own script, every phase in the same
processes (Lightning's launcher starts the other ranks from it).

Usage: ``python tests/generation_job.py SPEC.json OUT_DIR``. The spec holds ``devices`` and ``phases``; a phase has
``name``, ``model`` (``"lm"``, ``"nano"`` or ``"litgpt"``), ``model_kwargs``, ``strategy`` (``PipelineStrategy``
kwargs, or null for one device), ``fns`` (``fit``, which validates at the end of its epoch, and ``predict``) and
``expect_error``.
Each rank writes ``OUT_DIR/<name>.rank<r>.pt``: the tokens every validation step generated, the predictions, the
training losses, the callback metrics, and what the key-value caches were: which layers each rank's microbatch
caches held, their longest length, and how many were still alive after the phase. :func:`run_phase` runs one phase
in the calling process.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
import weakref
from typing import Any

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import generation_models as gm
import zoo
import zoo_job

from lightning_pipe import PipelineStrategy
from lightning_pipe._step import caches as _caches


class CacheWatch:
    """Records the microbatch caches the pipeline makes (weak references) and what they hold after each pass."""

    def __init__(self) -> None:
        self.made: list[weakref.ref] = []
        self.held_layers: set[int] = set()
        self.longest = 0
        self._for_rows = _caches.PassCaches.for_rows
        self._mirror = _caches.PassCaches.mirror

    def __enter__(self) -> CacheWatch:
        watch = self

        def for_rows(caches: Any, cache: Any, start: int, stop: int, probing: bool) -> Any:
            known = {id(c) for c in caches.live}
            sub = watch._for_rows(caches, cache, start, stop, probing)
            if not probing and id(sub) not in known:
                watch.made.append(weakref.ref(sub))
            return sub

        def mirror(caches: Any) -> None:
            for sub in caches.live:
                for part in _caches._parts(sub)[:1]:  # an encoder-decoder's: its self-attention cache
                    for index, layer in enumerate(part.layers):
                        if _caches._holds(layer):
                            watch.held_layers.add(index + caches.offset)  # the cache's layer 0 is block `offset`
                            watch.longest = max(watch.longest, layer.keys.shape[-2])
            watch._mirror(caches)

        _caches.PassCaches.for_rows, _caches.PassCaches.mirror = for_rows, mirror
        return self

    def __exit__(self, *exc: Any) -> None:
        _caches.PassCaches.for_rows, _caches.PassCaches.mirror = self._for_rows, self._mirror

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.made)


def run_phase(phase: dict[str, Any], devices: int) -> dict[str, Any]:
    torch.manual_seed(1234)
    kwargs = phase.get("model_kwargs", {})
    if phase["model"] in ("nano", "litgpt"):
        model: Any = (gm.NanoGenerator if phase["model"] == "nano" else gm.LitGPTGenerator)(**kwargs)
        train, val = zoo.loader("nanogpt", n=16), zoo.loader("nanogpt", n=16, seed=1)
    else:
        model = gm.GenerativeLM(**kwargs)
        train, val = gm.loader(), gm.loader(seed=1)
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            losses.append(float(outputs["loss"]))

    trainer_kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=devices, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False, max_epochs=1,
        callbacks=[Losses()], gradient_clip_val=0.5,
    )
    if phase.get("strategy") is not None:
        trainer_kwargs["strategy"] = PipelineStrategy(**phase["strategy"])
    trainer = L.Trainer(**trainer_kwargs)
    result: dict[str, Any] = {"error": None, "predictions": None}
    with CacheWatch() as watch:
        try:
            for fn in phase.get("fns", ["fit"]):
                if fn == "fit":
                    trainer.fit(model, train, val)
                elif fn == "predict":
                    result["predictions"] = [p.cpu() for p in trainer.predict(model, val)]
        except Exception as err:
            if not phase.get("expect_error"):
                raise
            result["error"] = "".join(traceback.format_exception_only(type(err), err))
    pipelined = isinstance(trainer.strategy, PipelineStrategy)
    result.update(
        generated=[g.clone() for g in model.generated],
        losses=losses,
        callback_metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
        caches_made=len(watch.made),
        caches_alive=watch.alive(),
        held_layers=sorted(watch.held_layers),
        longest_cache=watch.longest,
        rank=trainer.global_rank,
        bounds=[list(b) for b in trainer.strategy.layout.bounds] if pipelined and result["error"] is None else None,
        stage_ranks=(
            [trainer.strategy.layout.stage_rank(s) for s in range(trainer.strategy.layout.num_stages)]
            if pipelined and result["error"] is None else None
        ),
        pipeline_rank=trainer.strategy.pipeline_rank if pipelined else 0,
    )
    return result


if __name__ == "__main__":
    zoo_job.main(sys.argv[1], sys.argv[2], run=run_phase)
