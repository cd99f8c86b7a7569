"""Lightning's tensor-parallel example, ported: a ``configure_model`` written for ``ModelParallelStrategy`` trains
under ``PipelineStrategy`` with one changed line, the strategy.

Lightning's ``examples/pytorch/tensor_parallel`` trains a Llama with a ``configure_model`` that splits every
transformer block over ``self.device_mesh["tensor_parallel"]`` with ``parallelize_module`` (column-wise q/k/v and
w1/w3, row-wise o and w2, the per-rank head counts divided) and shards it over ``self.device_mesh["data_parallel"]``
with ``fully_shard``. Here the same ``configure_model`` runs; what differs from Lightning's file:

- the strategy line: ``PipelineStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel="fsdp")``
  instead of ``ModelParallelStrategy(tensor_parallel_size=2, data_parallel_size=...)``;
- no sequence parallelism (the pipeline hands whole activations from stage to stage; a sequence-parallel plan is
  refused at setup with this advice), and the sharding is the strategy's (``data_parallel="fsdp"``), so
  ``configure_model`` leaves out its ``fully_shard`` calls;
- the model is small, and the data is the bytes of Python's standard library (no download), so that it runs on a
  CPU laptop: 4 processes (gloo) by default.

    python examples/tensor_parallel.py                          # pp2 x tp2 on 4 CPU processes
    python examples/tensor_parallel.py --devices 8 --fsdp       # pp2 x fsdp2 x tp2
    python examples/tensor_parallel.py --strategy model_parallel --devices 2   # Lightning's own, for comparison

Both runs on their defaults end at the same training loss (2.572 after 20 steps), as does one process.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llama import Windows, load_corpus

from lightning_pipe import PipelineStrategy


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # `n_heads` is this rank's: `configure_model` divides it by the tensor-parallel size, as Lightning's does
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, n_heads), FeedForward(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, n_layers: int = 4, n_heads: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.layers = nn.ModuleList([TransformerBlock(dim, n_heads) for _ in range(n_layers)])
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: Transformer, device_mesh) -> Transformer:
    """Lightning's ``parallelize`` for this model, tensor parallelism only (see the module docstring)."""
    tp_mesh = device_mesh["tensor_parallel"]
    if tp_mesh.size() > 1:
        for block in model.layers:
            plan = {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            }
            block.attention.n_heads //= tp_mesh.size()
            parallelize_module(block, tp_mesh, plan)
    return model


class Llama(L.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = Transformer()

    def configure_model(self) -> None:
        parallelize(self.model, self.device_mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.model(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--strategy", choices=["pipeline", "model_parallel"], default="pipeline")
    parser.add_argument("--fsdp", action="store_true", help="shard each stage over its replicas")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    L.seed_everything(0)
    if args.strategy == "pipeline":  # the one changed line
        strategy = PipelineStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=4,
                                    data_parallel="fsdp" if args.fsdp else "ddp")
    else:
        strategy = ModelParallelStrategy(tensor_parallel_size=2, data_parallel_size=args.devices // 2)
    # Lightning shuffles the training sampler it injects; one replica needs none, so both strategies see one order
    one_replica = args.strategy == "model_parallel" and args.devices == 2
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, log_every_n_steps=5,
                        use_distributed_sampler=not one_replica)
    windows = Windows(load_corpus(1_000_000), seq_len=64, num_samples=8 * args.steps, seed=0)
    data = torch.utils.data.DataLoader(windows, batch_size=8)
    trainer.fit(Llama(), data)
    trainer.print(f"final training loss {float(trainer.callback_metrics['train_loss']):.3f}")


if __name__ == "__main__":
    main()
