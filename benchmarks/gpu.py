"""The single-GPU paths, checked and timed on one CUDA device in one run: NCCL, fp32 and bf16, and step times.

A GPU cannot host two NCCL ranks, so the pipeline runs its stages on one process here: ``Interleaved1F1B`` with two
stages on the one rank (``stages_per_rank=2``), which drives the same schedules, stage hand-over, microbatching,
loss weighting and gradient hand-back as a multi-rank run, over a NCCL process group of one. Three phases:

1. exactness: the example Llama (``examples/llama.py``) trained for a few steps with SGD by plain Lightning on the GPU
   and by ``PipelineStrategy``, in fp32 (losses and weights, max abs difference) and in ``bf16-mixed`` and
   ``bf16-true`` (losses);
2. timing, side by side in one run: (a) plain Lightning, (b) a hand-written ``torch.distributed.pipelining`` loop
   (two ``PipelineStage`` on one rank, ``ScheduleInterleaved1F1B``, the same microbatches, SGD), (c) the strategy
   with the same split and schedule; median step time after warm-up, bf16-mixed autocast in each;
3. the results as JSON (``--out``).

    python benchmarks/gpu.py --out gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from llama import LitLlama, LlamaConfig, Windows, load_corpus

from lightning_pipe import PipelineStrategy


class SGDLlama(LitLlama):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def synchronize(accelerator: str) -> None:
    """Wait for the GPU's queued work (``--accelerator cpu``: nothing is queued)."""
    if accelerator == "gpu":
        torch.cuda.synchronize()


class Steps(Callback):
    """Each training step's loss and start time (after a CUDA synchronise)."""

    def __init__(self, accelerator: str = "gpu") -> None:
        self.accelerator = accelerator
        self.losses: list[float] = []
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        synchronize(self.accelerator)
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _loader(args: argparse.Namespace, steps: int) -> torch.utils.data.DataLoader:
    data = Windows(load_corpus(1_000_000), args.seq_len, args.batch_size * steps, seed=0)
    return torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=False, drop_last=True)


def _config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_heads // 2,
                       max_seq_len=args.seq_len, vocab_size=args.vocab_size)


class CompiledLlama(SGDLlama):
    """Plain Lightning with every module of the backbone compiled, as ``PipelineStrategy(compile=True)`` compiles
    them."""

    def configure_model(self) -> None:
        for block in self.backbone:
            block.compile()


def fit(
    args: argparse.Namespace, pipeline: bool, precision: str, steps: int, compiled: bool = False,
    schedule: str = "Interleaved1F1B",
) -> tuple[Steps, dict[str, torch.Tensor]]:
    L.seed_everything(0)
    model = (CompiledLlama if compiled and not pipeline else SGDLlama)(_config(args), lr=args.lr)
    strategy: Any = "auto"
    if pipeline:
        strategy = PipelineStrategy(schedule=schedule, stages_per_rank=2,
                                    num_microbatches=args.num_microbatches, compile=compiled)
    record = Steps(args.accelerator)
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, strategy=strategy, precision=precision,
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[record], use_distributed_sampler=False)
    trainer.fit(model, _loader(args, steps))
    return record, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def exactness(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        ref, ref_w = fit(args, False, precision, args.check_steps)
        got, got_w = fit(args, True, precision, args.check_steps)
        out[precision] = {
            "losses_single": ref.losses, "losses_pipeline": got.losses,
            "max_loss_diff": max(abs(a - b) for a, b in zip(ref.losses, got.losses)),
            "max_weight_diff": max(float((ref_w[k] - got_w[k]).abs().max()) for k in ref_w),
        }
        print(precision, out[precision]["max_loss_diff"], out[precision]["max_weight_diff"], flush=True)
    return out


def torch_loop(args: argparse.Namespace, steps: int, compiled: bool = False) -> list[float]:
    """Two stages on one rank under ``ScheduleInterleaved1F1B``, SGD, bf16 autocast: the hand-written baseline
    (``compiled``: every module of the backbone compiled first, as ``compile=True`` compiles them)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    if not dist.is_initialized():  # a process group of one for the stages, unless a fit left its own
        backend = "nccl" if args.accelerator == "gpu" else "gloo"
        dist.init_process_group(backend, init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    L.seed_everything(0)
    device = torch.device("cuda", 0) if args.accelerator == "gpu" else torch.device("cpu")
    model = SGDLlama(_config(args), lr=args.lr).to(device)
    backbone = model.backbone
    blocks = list(backbone)
    for block in blocks if compiled else ():
        block.compile()
    half = len(blocks) // 2
    parts = [torch.nn.Sequential(*blocks[:half]).to(device), torch.nn.Sequential(*blocks[half:]).to(device)]
    group = dist.group.WORLD
    stages = [PipelineStage(part, i, 2, device, group=group) for i, part in enumerate(parts)]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten()) / args.num_microbatches

    schedule = ScheduleInterleaved1F1B(stages, args.num_microbatches, loss_fn=loss_fn, scale_grads=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    starts = []
    for x, y in _loader(args, steps):
        synchronize(args.accelerator)
        starts.append(time.perf_counter())
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            schedule.step(x, target=y)
        optimizer.step()
        optimizer.zero_grad()
    synchronize(args.accelerator)
    starts.append(time.perf_counter())
    return starts


def _median_step(starts: list[float], warmup: int) -> float:
    gaps = [b - a for a, b in zip(starts, starts[1:])][warmup:]
    return statistics.median(gaps)


def timing(args: argparse.Namespace) -> dict[str, Any]:
    steps = args.warmup + args.steps + 1
    single, _ = fit(args, False, "bf16-mixed", steps)
    strategy, _ = fit(args, True, "bf16-mixed", steps)
    loop = torch_loop(args, steps)
    out = {
        "single_s": _median_step(single.starts, args.warmup),
        "strategy_s": _median_step(strategy.starts, args.warmup),
        "torch_loop_s": _median_step(loop, args.warmup),
    }
    out["strategy_vs_torch_loop"] = out["torch_loop_s"] / out["strategy_s"]
    out["strategy_vs_single"] = out["single_s"] / out["strategy_s"]
    print(out, flush=True)
    return out


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The example Llama's size, its batches and SGD's learning rate (``gpu_auto.py`` takes them too)."""
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=8)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"),
                   help="cpu: check that the script runs (gloo, CPU autocast), on a small --dim; no GPU figure")


def run_arguments(p: argparse.ArgumentParser, steps: int = 20) -> None:
    """The microbatches, the steps checked and timed, and where the JSON goes (``gpu_compile.py`` takes them too)."""
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--check-steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--out", default=None)


def run_phases(args: argparse.Namespace, phases: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """Each phase's result by name, after the device, torch and the arguments; a phase that fails is reported and the
    others run: each is a separate finding."""
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else "cpu"
    result: dict[str, Any] = {"device": device, "torch": torch.__version__,
                              "args": vars(args)}
    for name, phase in phases:
        try:
            result[name] = phase(args)
        except Exception as error:
            result[name] = {"error": f"{type(error).__name__}: {error}"}
            print(name, "failed:", result[name]["error"], flush=True)
    return result


def write_result(result: dict[str, Any], out: Any) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    run_arguments(p)
    args = p.parse_args()
    write_result(run_phases(args, (("exactness", exactness), ("timing", timing))), args.out)


if __name__ == "__main__":
    main()
