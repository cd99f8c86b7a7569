"""Peak host memory per rank when a model is built on the meta device, and the cost of activation checkpointing.

    python benchmarks/memory.py            # runs every measurement and prints a table
    python benchmarks/memory.py --sharded  # part 4 only

Part 1 builds a ~600 MB (fp32) MLP-block model with ``trainer.init_module(empty_init=True)`` and runs one
training step with ``PipelineStrategy`` on 1, 2 and 4 CPU processes; each rank reports its peak resident set
size (``ru_maxrss``). Only the local stage is ever allocated, so the per-rank peak falls with the stage size.

Part 2 trains the same kind of model on 2 processes with and without ``activation_checkpointing=True`` and
reports, per rank, the bytes of activations autograd kept for backward (a saved-tensor hook counts them: a
deterministic stand-in for peak activation memory on CPU) and the median step time.

Part 4 shards the stages over their replicas: the ~600 MB model on meta, 4 CPU processes, one AdamW step, as
pp2 x ddp2 (replicated stages), pp2 x fsdp2 (sharded) and pp1 x fsdp4; each rank reports the bytes it holds of
parameters, gradients (at the optimizer step) and optimizer state (after it), and its peak RSS.

Part 3 is a GPT whose embedding and head are large (vocabulary 65536 x 512, 4 blocks of 512), built the usual way
(blocks in an ``nn.ModuleList`` run in a loop, embedding and head outside them), on meta, with and without the head
tied to the embedding: each rank holds its blocks plus the embedding (first stage) or the head (last stage); a tied
head lives on both.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import PipelineStrategy


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(L.LightningModule):
    def __init__(self, dim: int, blocks: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*[MLPBlock(dim) for _ in range(blocks)], nn.Linear(dim, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.backbone(x).squeeze(-1), y)

    def configure_optimizers(self):
        if getattr(self, "adamw", False):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class GPT(L.LightningModule):
    """Embedding, a loop over blocks, final norm, head (tied to the embedding or not), as language models are built."""

    def __init__(self, vocab: int, dim: int, blocks: int, tied: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([MLPBlock(dim) for _ in range(blocks)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.wte(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.lm_head(self.ln_f(h)).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Probe(L.Callback):
    def __init__(self, count_saved: bool) -> None:
        self.count_saved, self.saved, self.times = count_saved, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t0 = time.perf_counter()
        if self.count_saved:
            self.saved.append(0)

            def pack(t: torch.Tensor) -> torch.Tensor:
                self.saved[-1] += t.numel() * t.element_size()
                return t

            self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self.hooks.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.count_saved:
            self.hooks.__exit__(None, None, None)
        self.times.append(time.perf_counter() - self.t0)
        optimizer = trainer.optimizers[0]
        self.state_bytes = sum(_bytes(v) for s in optimizer.state.values() for v in s.values() if v.dim() > 0)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grad_bytes = sum(_bytes(p.grad) for p in pl_module.parameters() if p.grad is not None)


def _bytes(t: torch.Tensor) -> int:
    """The bytes this rank holds of ``t`` (its shard of a sharded tensor)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def worker(args: dict) -> None:
    torch.manual_seed(0)
    if args.get("vocab"):
        tokens = torch.randint(0, args["vocab"], (64, args["seq"]))
        data = TensorDataset(tokens, torch.roll(tokens, -1, 1))
    else:
        data = TensorDataset(torch.randn(64, args["seq"], args["dim"]), torch.randn(64, args["seq"]))
    probe = Probe(count_saved=args["count_saved"])
    trainer = L.Trainer(
        accelerator="cpu", devices=args["devices"], max_steps=args["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
        strategy=PipelineStrategy(
            num_microbatches=4, activation_checkpointing=args["ac"], data_parallel=args.get("data_parallel", "ddp"),
            pipeline_parallel_size=args.get("pp", "auto"),
        ),
    )
    with trainer.init_module(empty_init=True):
        if args.get("vocab"):
            model: L.LightningModule = GPT(args["vocab"], args["dim"], args["blocks"], args["tied"])
        else:
            model = Model(args["dim"], args["blocks"])
    model.adamw = args.get("adamw", False)
    trainer.fit(model, DataLoader(data, batch_size=args["batch"]))
    params = sum(_bytes(p) for p in model.parameters())
    out = {
        "grads_mb": getattr(probe, "grad_bytes", 0) / 2**20, "state_mb": getattr(probe, "state_bytes", 0) / 2**20,
        "rank": trainer.global_rank, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "local_params_mb": params / 2**20, "saved_mb": max(probe.saved, default=0) / 2**20,
        "step_s": statistics.median(probe.times[1:]) if len(probe.times) > 1 else probe.times[0],
    }
    Path(args["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def run(
    devices: int, dim: int, blocks: int, ac: bool, count_saved: bool, steps: int, seq: int, batch: int, **gpt: Any
) -> list[dict]:
    out = tempfile.mkdtemp()
    args = dict(devices=devices, dim=dim, blocks=blocks, ac=ac, count_saved=count_saved, steps=steps, seq=seq,
                batch=batch, out=out, **gpt)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    subprocess.run([sys.executable, __file__, "--worker", json.dumps(args)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(devices)]


def sharded() -> None:
    print("Part 4: stages sharded over their replicas, the ~600 MB model on meta, 4 processes, one AdamW step")
    print(f"{'layout':>11} {'rank':>4} {'params MB':>10} {'grads MB':>9} {'AdamW state MB':>15} {'peak RSS MB':>12}")
    for label, pp, mode in (("pp2 x ddp2", 2, "ddp"), ("pp2 x fsdp2", 2, "fsdp"), ("pp1 x fsdp4", 1, "fsdp")):
        for r in run(4, dim=1024, blocks=18, ac=False, count_saved=False, steps=1, seq=8, batch=8, pp=pp,
                     data_parallel=mode, adamw=True):
            print(f"{label:>11} {r['rank']:>4} {r['local_params_mb']:>10.0f} {r['grads_mb']:>9.0f}"
                  f" {r['state_mb']:>15.0f} {r['peak_rss_mb']:>12.0f}")


def main() -> None:
    if "--sharded" in sys.argv:  # part 4 only
        sys.argv.remove("--sharded")
        return sharded()
    print("Part 1: model built on meta, ~600 MB of fp32 parameters, one step")
    print(f"{'processes':>9} {'rank':>4} {'local params MB':>16} {'peak RSS MB':>12}")
    for devices in (1, 2, 4):
        for r in run(devices, dim=1024, blocks=18, ac=False, count_saved=False, steps=1, seq=8, batch=8):
            print(f"{devices:>9} {r['rank']:>4} {r['local_params_mb']:>16.0f} {r['peak_rss_mb']:>12.0f}")
    print("\nPart 2: activation checkpointing, 2 processes, dim 512 x 8 blocks, batch 32 x seq 128")
    print(f"{'checkpointing':>13} {'rank':>4} {'saved activations MB':>21} {'step s':>8}")
    for ac in (False, True):
        for r in run(2, dim=512, blocks=8, ac=ac, count_saved=True, steps=6, seq=128, batch=32):
            print(f"{str(ac):>13} {r['rank']:>4} {r['saved_mb']:>21.1f} {r['step_s']:>8.3f}")
        for r in run(2, dim=512, blocks=8, ac=ac, count_saved=False, steps=6, seq=128, batch=32):
            print(f"{'(timing)':>13} {r['rank']:>4} {'':>21} {r['step_s']:>8.3f}")
    print("\nPart 3: GPT with a large embedding and head (vocabulary 65536 x 512, 4 blocks), built on meta, one step")
    print(f"{'head':>6} {'processes':>9} {'rank':>4} {'local params MB':>16} {'peak RSS MB':>12}")
    for tied in (False, True):
        for devices in (1, 2):
            gpt = dict(vocab=65536, tied=tied)
            for r in run(devices, dim=512, blocks=4, ac=False, count_saved=False, steps=1, seq=32, batch=8, **gpt):
                label = "tied" if tied else "own"
                print(f"{label:>6} {devices:>9} {r['rank']:>4} {r['local_params_mb']:>16.0f} {r['peak_rss_mb']:>12.0f}")
    print()
    sharded()


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]))
    else:
        main()
