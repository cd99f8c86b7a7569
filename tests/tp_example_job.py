"""Lightning's tensor-parallel example (``examples/tensor_parallel``, its ``Llama3`` as published but for a CPU-sized
config) trained under ``PipelineStrategy``, under Lightning's ``ModelParallelStrategy`` and on one process, from the
same full weights, so that the losses and weights of every step can be compared.

Usage: ``python tests/tp_example_job.py SPEC.json OUT_DIR``. The spec holds ``devices`` and a list of ``phases``, run
one after the other in the same processes. A phase:

- ``name``: where its results go (``OUT_DIR/<name>.rank<r>.pt``);
- ``strategy``: ``"pipeline"`` (``PipelineStrategy(**strategy_kwargs)``), ``"model_parallel"``
  (``ModelParallelStrategy(**strategy_kwargs)``), or null: a plain ``Trainer(devices=1)``;
- ``optimizer``: ``"adamw"`` (the example's own ``configure_optimizers``) or ``"sgd"``;
- ``fp32_policy``: the example's ``fully_shard`` branch gets ``MixedPrecisionPolicy(param_dtype=torch.float32)`` in
  place of its bf16 one (patched here, at the test's level; the example is unchanged);
- ``use_distributed_sampler``: the Trainer's flag. With one data-parallel replica it is off, so that every run, the
  one process too, reads the batches in order; with two, both strategies give Lightning's sampler the same replica
  count and seed, so the two replicas together see the same samples under either;
- ``example``: run the example's own ``train()`` as published instead (its ``on_train_start`` re-initialises the
  sharded weights, so nothing is compared; it must train);
- ``fp8``: train Lightning's fp8 example (``tests/fp8_example.py``) instead, in ``precision``.

The example's ``on_train_start`` draws new weights on the sharded tensors, with each strategy's own random numbers.
Here :class:`FromFullWeights` loads instead the one full state dict :func:`full_weights` into whatever this rank holds
(its stage under ``PipelineStrategy``, DTensor shards under either), through ``state_dict``/``load_state_dict`` under
the original names. Every rank records the loss of every step (its own, and the mean over all ranks: the mean over
the data-parallel replicas, as each replica's ranks hold the same), its state dict right after the load and after
training, and the error, if a phase raised; the first error ends the launch (Lightning's launcher kills the other
ranks when rank 0 fails), so later phases leave no results.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor, distribute_tensor

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "tensor_parallel"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from helpers import plain  # noqa: E402

from lightning_pipe import PipelineStrategy  # noqa: E402

STEPS = 5
SGD_LR = 1.0
SEED = 1234
EXAMPLE_MODULES = ("train", "model", "parallelism", "data")  # train.py imports its neighbours by these bare names


def example_module(name: str):
    """One of the example's modules, imported as its ``train.py`` imports them (by bare name, from its folder)."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    import importlib

    module = importlib.import_module(name)
    assert Path(module.__file__).parent == EXAMPLE, f"`{name}` is {module.__file__}, not the example's"
    return module


def forget_example() -> None:
    """Drop the example's bare module names again (for a caller that runs a phase in a process it shares)."""
    for name in EXAMPLE_MODULES:
        sys.modules.pop(name, None)
    with contextlib.suppress(ValueError):
        sys.path.remove(str(EXAMPLE))


@functools.cache
def full_weights() -> dict[str, torch.Tensor]:
    """The example's ``Llama3`` built whole on this CPU from a fixed seed: the same in every process."""
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = example_module("train").Llama3()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def load_full(module: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load the full tensors into what ``module`` holds on this rank: its own keys only, each DTensor given its
    local part of the full tensor (cut locally: every rank has the whole of it)."""
    own = module.state_dict()
    missing = set(own) - set(full)
    assert not missing, f"keys the full model does not have: {sorted(missing)}"
    state = {}
    for key, value in own.items():
        source = full[key].to(value.dtype)
        if isinstance(value, DTensor):
            source = distribute_tensor(source, value.device_mesh, value.placements, src_data_rank=None)
        state[key] = source
    module.load_state_dict(state, strict=True)


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        local = float(loss)
        mean = local
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor([local], dtype=torch.float64)
            dist.all_reduce(t)
            mean = t.item() / dist.get_world_size()
        self.steps.append({"loss": local, "mean_loss": mean})


@contextlib.contextmanager
def fp32_policy(enabled: bool) -> Iterator[None]:
    """The example's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...)`` computing in fp32 instead."""
    if not enabled:
        yield
        return
    parallelism = example_module("parallelism")
    original = parallelism.MixedPrecisionPolicy

    def policy(**kwargs: Any):
        return original(**{**kwargs, "param_dtype": torch.float32})

    parallelism.MixedPrecisionPolicy = policy
    try:
        yield
    finally:
        parallelism.MixedPrecisionPolicy = original


def make_strategy(phase: dict[str, Any]):
    kind, kwargs = phase.get("strategy"), phase.get("strategy_kwargs", {})
    if kind == "pipeline":
        return PipelineStrategy(**kwargs)
    if kind == "model_parallel":
        return ModelParallelStrategy(**kwargs)
    assert kind is None, kind
    return "auto"


def run_phase(phase: dict[str, Any], devices: int) -> dict[str, Any]:
    if phase.get("fp8"):  # Lightning's fp8 example instead (tests/fp8_example.py)
        import fp8_example

        return fp8_example.run_phase(phase, devices, Recorder())
    if phase.get("example"):
        example_module("train").train(**phase.get("example_kwargs", {}))
        return {"error": None, "rank": dist.get_rank() if dist.is_initialized() else 0}

    Llama3 = example_module("train").Llama3

    class FromFullWeights(Llama3):
        """The example's module, started from :func:`full_weights` instead of its own ``init_weights`` on the
        sharded tensors; SGD in place of its AdamW when asked; on one process, not split (there is no mesh)."""

        def __init__(self, optimizer: str) -> None:
            super().__init__()
            self.optimizer_name = optimizer
            self.initial: Optional[dict[str, torch.Tensor]] = None

        def configure_model(self) -> None:
            if self.device_mesh is not None:  # one process, no strategy: no mesh, nothing to split
                super().configure_model()

        def on_train_start(self) -> None:
            load_full(self, full_weights())
            self.initial = plain(self.state_dict())

        def configure_optimizers(self):
            if self.optimizer_name == "sgd":
                return torch.optim.SGD(self.model.parameters(), lr=SGD_LR)
            return super().configure_optimizers()

    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices if phase.get("strategy") else 1, strategy=make_strategy(phase),
        max_steps=phase.get("steps", STEPS), limit_train_batches=phase.get("steps", STEPS), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=phase.get("use_distributed_sampler", False),
        callbacks=[recorder],
    )
    with fp32_policy(phase.get("fp32_policy", False)):
        with trainer.init_module(empty_init=True):
            model = FromFullWeights(phase.get("optimizer", "adamw"))
        trainer.fit(model)
    return {
        "error": None,
        "rank": trainer.global_rank,
        "steps": recorder.steps,
        "initial": model.initial,
        "state_dict": plain(model.state_dict()),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }


def main(spec_file: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for phase in spec["phases"]:
        print(f"--- phase {phase['name']}", flush=True)
        try:
            result = run_phase(phase, spec["devices"])
        except BaseException as err:
            rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
            message = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            torch.save({"error": message, "rank": rank}, out / f"{phase['name']}.rank{rank}.pt")
            raise
        torch.save(result, out / f"{phase['name']}.rank{result['rank']}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
