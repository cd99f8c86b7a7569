"""Train a Vision Transformer with pipeline parallelism, and validate it with torchmetrics, in one file.

The model is the ViT of Colossal-AI's "Train ViT Using Pipeline Parallelism" tutorial, which rewrites timm's
``VisionTransformer`` as one ``nn.Sequential``: a patch embedding (patches, class token, position embedding),
transformer blocks, and a head (norm, then a linear layer on the class token). Here that sequence is the
LightningModule's ``backbone``, which ``PipelineStrategy`` cuts into stages, one per process. Every module in it
takes and returns one tensor, so a stage can end after any of them. The LightningModule is ordinary:
``training_step`` returns the loss, ``validation_step`` logs a loss and a torchmetrics accuracy.

Data: synthetic 32x32 RGB images by default, with no download and no torchvision. Each of the 10 classes has its
own coloured stripe pattern (orientation, frequency, colour), shifted at random and buried in noise, so accuracy
starts at chance (10%) and rises within an epoch or two. To train on CIFAR-10 instead, download and unpack the
"CIFAR-10 python version" (https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz) and pass the directory that
holds ``cifar-10-batches-py`` (or that directory itself)::

    python examples/vit.py                               # 2 CPU processes (gloo), synthetic images
    python examples/vit.py --devices 4 --depth 8         # 4 stages
    python examples/vit.py --data-dir ~/data --max-epochs 30 --dim 192 --depth 9   # CIFAR-10

Defaults finish in about a minute and a half on a 2-core CPU. With CUDA, ``--accelerator auto`` uses one GPU
per process.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_pipe import SCHEDULE_NAMES, PipelineStrategy

NUM_CLASSES = 10


# ----------------------------------------------------------------------------------------------------- model
class PatchEmbedding(nn.Module):
    """Image ``(B, C, H, W)`` to tokens ``(B, 1 + patches, dim)``: patches, a class token, a position embedding."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, dim: int, dropout: float) -> None:
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"--img-size {img_size} must be a multiple of --patch-size {patch_size}.")
        num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, dim) * 0.02)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)  # (B, patches, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # a parameter: already on the input's device
        return self.drop(torch.cat((cls, x), dim=1) + self.pos_embed)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    """timm's pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, dropout: float) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final norm and classifier on the class token: ``(B, T, dim)`` to logits ``(B, classes)``."""

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x)[:, 0])


def build_vit(
    img_size: int = 32, patch_size: int = 4, dim: int = 128, depth: int = 6, heads: int = 4, mlp_ratio: float = 2.0,
    dropout: float = 0.0, num_classes: int = NUM_CLASSES,
) -> nn.Sequential:
    if dim % heads:
        raise ValueError(f"--dim {dim} must be divisible by --heads {heads}.")
    backbone = nn.Sequential(
        PatchEmbedding(img_size, patch_size, 3, dim, dropout),
        *[Block(dim, heads, mlp_ratio, dropout) for _ in range(depth)],
        Head(dim, num_classes),
    )
    for m in backbone.modules():  # timm's init: truncated normal linear weights, zero biases
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
    return backbone


class LitViT(L.LightningModule):
    def __init__(self, lr: float = 1e-3, weight_decay: float = 0.05, max_epochs: int = 3, **vit_kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = build_vit(**vit_kwargs)
        self.val_acc = MulticlassAccuracy(num_classes=NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.val_acc.update(logits, labels)
        self.log("val_acc", self.val_acc, prog_bar=True)  # computed (and synced) by Lightning at epoch end

    def configure_optimizers(self) -> Any:
        # Under PipelineStrategy, self.parameters() holds this process's stages only.
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(self.hparams.max_epochs, 1))
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


# ------------------------------------------------------------------------------------------------------ data
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def synthetic_images(num: int, img_size: int, seed: int, noise: float = 1.5) -> TensorDataset:
    """``num`` images whose class is a coloured stripe pattern: class ``c`` has its own orientation, frequency and
    colour; every image shifts it by a random phase and adds Gaussian noise. The patterns are fixed (seed 0), the
    samples come from ``seed``."""
    patterns = torch.Generator().manual_seed(0)
    angles = torch.rand(NUM_CLASSES, generator=patterns) * torch.pi
    freqs = 0.3 + 0.5 * torch.rand(NUM_CLASSES, generator=patterns)
    colours = torch.rand(NUM_CLASSES, 3, generator=patterns) * 2 - 1
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (num,), generator=g)
    coords = torch.arange(img_size, dtype=torch.float32)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    a, f = angles[labels].view(-1, 1, 1), freqs[labels].view(-1, 1, 1)
    phase = torch.rand(num, 1, 1, generator=g) * 2 * torch.pi
    wave = torch.sin(f * (xx * torch.cos(a) + yy * torch.sin(a)) + phase)  # (num, H, W)
    images = wave.unsqueeze(1) * colours[labels].view(-1, 3, 1, 1)
    images = images + noise * torch.randn(num, 3, img_size, img_size, generator=g)
    return TensorDataset(images, labels)


def cifar10(data_dir: str, train: bool) -> TensorDataset:
    """CIFAR-10 from the python pickle batches (``data_batch_1..5`` or ``test_batch``), normalised."""
    root = Path(data_dir).expanduser()
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] if train else ["test_batch"]
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"--data-dir {data_dir}: no {missing[0]} in {root}. Pass the directory holding `cifar-10-batches-py` (the"
            " unpacked https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz), or leave --data-dir out to train on"
            " synthetic images."
        )
    data, labels = [], []
    for name in names:
        with open(root / name, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
        data.append(torch.as_tensor(batch[b"data"]).view(-1, 3, 32, 32))
        labels.append(torch.as_tensor(batch[b"labels"]))
    images = torch.cat(data).float() / 255.0
    images = (images - torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)) / torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    return TensorDataset(images, torch.cat(labels).long())


def make_loaders(args: argparse.Namespace) -> tuple[DataLoader, DataLoader]:
    if args.data_dir:
        train, val = cifar10(args.data_dir, train=True), cifar10(args.data_dir, train=False)
    else:
        train = synthetic_images(args.train_samples, args.img_size, seed=args.seed)
        val = synthetic_images(args.val_samples, args.img_size, seed=args.seed + 1)
    # drop_last: every training batch splits into equal microbatches; validation keeps its ragged last batch.
    return (
        DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True),
        DataLoader(val, batch_size=args.batch_size, shuffle=False),
    )


# ------------------------------------------------------------------------------------------------------ main
class EpochSummary(L.Callback):
    """Prints the validation metrics after every epoch (rank 0; every rank holds the same values)."""

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            metrics = trainer.callback_metrics
            print(f"epoch {trainer.current_epoch}: val_loss {float(metrics['val_loss']):.4f}, "
                  f"val_acc {float(metrics['val_acc']):.4f}")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=2, help="processes = pipeline stages")
    p.add_argument("--accelerator", default="auto", help="'auto': CUDA when available, else CPU")
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1F1B", choices=SCHEDULE_NAMES)
    p.add_argument("--max-epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-samples", type=int, default=2048, help="synthetic data only")
    p.add_argument("--val-samples", type=int, default=500, help="synthetic data only")
    p.add_argument("--data-dir", default=None, help="directory with cifar-10-batches-py; synthetic images if unset")
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    if args.data_dir and args.img_size != 32:
        p.error("CIFAR-10 images are 32x32: use --img-size 32 with --data-dir.")
    if args.batch_size % args.num_microbatches:
        p.error(f"--num-microbatches {args.num_microbatches} must divide --batch-size {args.batch_size}.")
    if args.devices > args.depth + 2:
        p.error(f"--devices {args.devices} needs at least {args.devices} backbone modules: raise --depth.")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    L.seed_everything(args.seed)
    model = LitViT(
        lr=args.lr, max_epochs=args.max_epochs, img_size=args.img_size, patch_size=args.patch_size, dim=args.dim,
        depth=args.depth, heads=args.heads,
    )
    n_params = sum(p.numel() for p in model.parameters())  # counted before the strategy splits the backbone
    train_loader, val_loader = make_loaders(args)
    # The pipeline talks over gloo (CPU) or NCCL (CUDA); Apple's MPS has neither, so "auto" means CPU there.
    accelerator = args.accelerator
    if accelerator == "auto" and not torch.cuda.is_available():
        accelerator = "cpu"
    strategy = PipelineStrategy(num_microbatches=args.num_microbatches, schedule=args.schedule)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.max_epochs,
        log_every_n_steps=10,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        num_sanity_val_steps=0,
        callbacks=[EpochSummary()],
    )
    trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 4) for k, v in trainer.callback_metrics.items()}
        print(f"ViT: {n_params / 1e6:.2f}M parameters; {strategy.layout.describe()}")
        print(f"final metrics: {metrics} (chance accuracy is {1 / NUM_CLASSES:.2f})")


if __name__ == "__main__":
    main()
