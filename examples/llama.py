"""Train a small Llama-style language model with pipeline parallelism, in one file.

The model follows Llama: RMSNorm, rotary position embeddings, grouped-query attention (fewer key/value heads
than query heads) and a SwiGLU MLP. All of it sits in one ``nn.Sequential`` named ``backbone``
(embedding, blocks, norm, head), which ``PipelineStrategy`` cuts into stages, one per process. The
LightningModule itself is ordinary: ``training_step`` calls the model once and returns the loss.

The data is real text that needs no download: the bytes of the ``*.py`` files of Python's own standard
library (vocabulary 256), read in sorted order and cut into random fixed-length windows by a seeded generator.

    python examples/llama.py                      # 2 CPU processes (gloo), or every GPU when CUDA exists
    python examples/llama.py --devices 1          # one process: the whole model in a single stage
    python examples/llama.py --schedule GPipe --num-microbatches 4 --n-layers 6 --dim 192

With the defaults each process needs about 20 s of CPU time (about a minute in all on an idle 2-core laptop) and
the validation loss falls from ln(256) = 5.5 to about 2.9. Checkpoints are per-stage directories; to get one
ordinary file that ``LitLlama.load_from_checkpoint`` reads without any strategy:

    python -m lightning_pipe.consolidate lightning_logs/version_0/checkpoints/last.ckpt llama.ckpt
"""

from __future__ import annotations

import argparse
import glob
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pipe import SCHEDULE_NAMES, PipelineStrategy


@dataclass
class LlamaConfig:
    vocab_size: int = 256  # bytes
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: each key/value head serves n_heads // n_kv_heads query heads
    multiple_of: int = 32  # SwiGLU hidden size is rounded up to a multiple of this, as in Llama
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}.")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"The head size dim // n_heads = {self.dim // self.n_heads} must be even for rotary.")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# ----------------------------------------------------------------------------------------------------- model
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angle of every (position, channel pair): two ``(max_seq_len, head_dim // 2)``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of channels ``(x[2i], x[2i+1])`` of ``x: (B, heads, T, head_dim)`` by its angle."""
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Each block keeps its own tables: blocks land on different stages (processes, devices). Buffers follow
        # the module to its device and into shape inference; persistent=False keeps them out of checkpoints.
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.cos[:T], self.sin[:T]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` with Llama's hidden size, 2/3 of 4 * dim rounded up."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hidden = int(2 * 4 * cfg.dim / 3)
        hidden = cfg.multiple_of * math.ceil(hidden / cfg.multiple_of)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block. Takes and returns one ``(B, T, dim)`` tensor, so a stage can end after it."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


def build_backbone(cfg: LlamaConfig) -> nn.Sequential:
    """Embedding, blocks, norm, head. The head is not tied to the embedding: they usually sit on different stages."""
    backbone = nn.Sequential(
        nn.Embedding(cfg.vocab_size, cfg.dim),
        *[Block(cfg) for _ in range(cfg.n_layers)],
        RMSNorm(cfg.dim, cfg.norm_eps),
        nn.Linear(cfg.dim, cfg.vocab_size, bias=False),
    )
    for name, p in backbone.named_parameters():
        if p.dim() == 2:  # GPT-2 style init; residual projections scaled down with depth
            std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
    return backbone


class LitLlama(L.LightningModule):
    def __init__(
        self,
        config: Union[LlamaConfig, dict],
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 10,
        max_steps: int = 60,
    ) -> None:
        super().__init__()
        self.config = config if isinstance(config, LlamaConfig) else LlamaConfig(**config)
        # The config is saved as a plain dict: checkpoints then load without this script's classes.
        hparams = dict(lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, max_steps=max_steps)
        self.save_hyperparameters({"config": asdict(self.config), **hparams})
        self.backbone = build_backbone(self.config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.backbone(idx)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        # Under PipelineStrategy, self.parameters() holds this process's stages only.
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
        warmup, total = self.hparams.warmup_steps, max(self.hparams.max_steps, 1)

        def lr_factor(step: int) -> float:  # linear warm-up, then cosine decay to 10%
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ------------------------------------------------------------------------------------------------------ data
def load_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The standard library's top-level ``*.py`` files, sorted by name, as one uint8 tensor of at most ``max_bytes``."""
    root = os.path.dirname(os.__file__)
    chunks, size = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            chunks.append(f.read() + b"\n\n")
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    data = b"".join(chunks)[:max_bytes]
    if len(data) < 100_000:
        raise RuntimeError(f"Found only {len(data)} bytes of Python source under {root}; need at least 100 kB.")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class Windows(Dataset):
    """``num_samples`` random windows of ``data``: input ``seq_len`` bytes and the same shifted by one as target."""

    def __init__(self, data: torch.Tensor, seq_len: int, num_samples: int, seed: int) -> None:
        if len(data) <= seq_len + 1:
            raise ValueError(f"A split of {len(data)} bytes is too short for windows of {seq_len}.")
        generator = torch.Generator().manual_seed(seed)
        self.data, self.seq_len = data, seq_len
        self.starts = torch.randint(0, len(data) - seq_len - 1, (num_samples,), generator=generator)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.starts[i])
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def make_loaders(
    seq_len: int, batch_size: int, train_samples: int, val_batches: int = 4, seed: int = 0
) -> tuple[DataLoader, DataLoader]:
    """Train windows from the first 90% of the corpus, validation windows from the last 10%."""
    data = load_corpus()
    split = int(0.9 * len(data))
    train = Windows(data[:split], seq_len, train_samples, seed=seed)
    val = Windows(data[split:], seq_len, val_batches * batch_size, seed=seed + 1)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True),
        DataLoader(val, batch_size=batch_size, shuffle=False),
    )


# ------------------------------------------------------------------------------------------------------ main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if cuda else 2, help="processes = stages")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--num-microbatches", type=int, default=8)
    p.add_argument("--schedule", default="1F1B", choices=SCHEDULE_NAMES)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--val-every", type=int, default=20, help="validate every N training steps")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args(argv)
    if args.batch_size < args.num_microbatches:
        p.error(f"--batch-size {args.batch_size} must be at least --num-microbatches {args.num_microbatches}.")
    if args.batch_size % args.num_microbatches:
        p.error(f"--num-microbatches {args.num_microbatches} must divide --batch-size {args.batch_size}.")
    if args.devices < 1 or args.max_steps < 1:
        p.error("--devices and --max-steps must be positive.")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    L.seed_everything(args.seed)
    config = LlamaConfig(dim=args.dim, n_layers=args.n_layers, max_seq_len=args.seq_len)
    model = LitLlama(config, lr=args.lr, max_steps=args.max_steps)
    n_params = sum(p.numel() for p in model.parameters())  # counted before the strategy splits the backbone
    train_samples = args.max_steps * args.batch_size
    train_loader, val_loader = make_loaders(args.seq_len, args.batch_size, train_samples, seed=args.seed)

    # balance="parameters": stages of about equal size (the embedding and head are small next to a block).
    strategy = PipelineStrategy(num_microbatches=args.num_microbatches, schedule=args.schedule, balance="parameters")
    trainer = L.Trainer(
        # The pipeline talks over gloo (CPU) or NCCL (CUDA); Apple's MPS has neither, so "auto" means CPU there.
        accelerator="auto" if torch.cuda.is_available() else "cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        max_epochs=1,  # the loader holds max_steps batches; without it the progress bar reads "Epoch 0/-2"
        val_check_interval=min(args.val_every, args.max_steps),
        check_val_every_n_epoch=None,
        log_every_n_steps=10,
        callbacks=[ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=1, save_last=True)],
    )
    trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader)

    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"model: {n_params / 1e6:.2f}M parameters; {strategy.layout.describe()}")
        print(f"final metrics: {metrics} (a uniform guess scores ln(256) = {math.log(256):.2f})")
        print(f"best checkpoint: {trainer.checkpoint_callback.best_model_path}")


if __name__ == "__main__":
    main()
