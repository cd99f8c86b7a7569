"""Train a ResNet with pipeline parallelism and the 1F1B schedule, and validate it with torchmetrics, in one file.

The model is the ResNet-50 of Colossal-AI's pipeline-parallel (1F1B) tutorial, which lays torchvision's
``resnet50`` out as one ``nn.Sequential``: the stem (7x7 convolution, BatchNorm, ReLU, max-pool), the 16
bottleneck blocks of its four stages, and the head (global average pooling, then a linear layer). Here that
sequence is the LightningModule's ``backbone``, written out without torchvision; ``PipelineStrategy`` cuts it into
stages, one per process, and runs it with the 1F1B schedule. Every module in it takes and returns one tensor.

``--depth 50 --width 64`` is ResNet-50 itself (23.5M parameters). The default, ``--depth 26 --width 16`` (two
bottlenecks per stage, a quarter of the channels), trains on a 2-core CPU in about a minute. ``--stem cifar``
swaps the ImageNet stem for a 3x3 convolution without pooling, the usual choice for 32x32 images (more compute,
better accuracy on CIFAR-10).

BatchNorm and microbatches: in training every microbatch is normalised with its own statistics and updates the
running statistics once, as every device does under DDP; with ``--num-microbatches 4`` and ``--batch-size 64``
BatchNorm sees batches of 16. SyncBatchNorm does not apply: the stages hold different layers, and a layer's
microbatches pass through it one after another. Validation uses the running statistics and leaves them alone.

Data: synthetic 32x32 RGB images by default, with no download and no torchvision. Each of the 10 classes has its
own coloured stripe pattern (orientation, frequency, colour), shifted at random and buried in noise, so accuracy
starts at chance (10%) and rises within an epoch or two. To train on CIFAR-10 instead, download and unpack the
"CIFAR-10 python version" (https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz) and pass the directory that
holds ``cifar-10-batches-py`` (or that directory itself)::

    python examples/resnet.py                                  # 2 CPU processes (gloo), synthetic images
    python examples/resnet.py --devices 4 --depth 50 --width 64   # ResNet-50 on 4 stages
    python examples/resnet.py --data-dir ~/data --stem cifar --max-epochs 30   # CIFAR-10

With CUDA, ``--accelerator auto`` uses one GPU per process.
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
#: Bottleneck blocks in each of the four stages, by depth (3 convolutions per block, plus the stem and the head).
BLOCKS = {14: (1, 1, 1, 1), 26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


# ----------------------------------------------------------------------------------------------------- model
def conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Sequential:
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(c_out))


class Stem(nn.Module):
    """ImageNet stem (7x7/2 convolution, BatchNorm, ReLU, 3x3/2 max-pool: 32x32 becomes 8x8), or the CIFAR stem
    (3x3 convolution, BatchNorm, ReLU, full resolution)."""

    def __init__(self, width: int, kind: str) -> None:
        super().__init__()
        if kind == "imagenet":
            self.layers = nn.Sequential(conv_bn(3, width, 7, stride=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        else:
            self.layers = nn.Sequential(conv_bn(3, width, 3), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided in the first block of a stage, as in torchvision's v1.5), 1x1 expand by 4, plus
    the shortcut (a strided 1x1 projection where the shape changes)."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.residual = nn.Sequential(
            conv_bn(c_in, width, 1), nn.ReLU(inplace=True),
            conv_bn(width, width, 3, stride=stride), nn.ReLU(inplace=True),
            conv_bn(width, c_out, 1),
        )
        nn.init.zeros_(self.residual[-1][1].weight)  # each block starts as the identity: deep nets train at once
        self.shortcut = conv_bn(c_in, c_out, 1, stride=stride) if stride != 1 or c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.residual(x) + self.shortcut(x))


class Head(nn.Module):
    """Global average pooling and the classifier: ``(B, C, H, W)`` to logits ``(B, classes)``."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def build_resnet(
    depth: int = 50, width: int = 64, stem: str = "imagenet", num_classes: int = NUM_CLASSES
) -> nn.Sequential:
    """Stem, every bottleneck block, head: ``sum(BLOCKS[depth]) + 2`` modules in one ``nn.Sequential``."""
    if depth not in BLOCKS:
        raise ValueError(f"--depth {depth} is not a bottleneck ResNet; choose one of {sorted(BLOCKS)}.")
    layers: list[nn.Module] = [Stem(width, stem)]
    channels = width
    for stage, count in enumerate(BLOCKS[depth]):
        stage_width = width * 2**stage
        for i in range(count):
            layers.append(Bottleneck(channels, stage_width, stride=2 if stage > 0 and i == 0 else 1))
            channels = stage_width * Bottleneck.expansion
    layers.append(Head(channels, num_classes))
    backbone = nn.Sequential(*layers)
    for m in backbone.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return backbone


class LitResNet(L.LightningModule):
    def __init__(
        self, lr: float = 0.05, weight_decay: float = 5e-4, max_epochs: int = 5, depth: int = 26, width: int = 16,
        stem: str = "imagenet",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = build_resnet(depth, width, stem)
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
        optimizer = torch.optim.SGD(
            self.parameters(), lr=self.hparams.lr, momentum=0.9, weight_decay=self.hparams.weight_decay, nesterov=True
        )
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
    p.add_argument("--max-epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--train-samples", type=int, default=2048, help="synthetic data only")
    p.add_argument("--val-samples", type=int, default=500, help="synthetic data only")
    p.add_argument("--data-dir", default=None, help="directory with cifar-10-batches-py; synthetic images if unset")
    p.add_argument("--depth", type=int, default=26, choices=sorted(BLOCKS))
    p.add_argument("--width", type=int, default=16, help="channels of the stem; 64 in ResNet-50")
    p.add_argument("--stem", default="imagenet", choices=["imagenet", "cifar"])
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    args.img_size = 32
    if args.batch_size % args.num_microbatches:
        p.error(f"--num-microbatches {args.num_microbatches} must divide --batch-size {args.batch_size}.")
    if args.devices > sum(BLOCKS[args.depth]) + 2:
        p.error(f"--devices {args.devices} needs at least {args.devices} backbone modules: raise --depth.")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    L.seed_everything(args.seed)
    model = LitResNet(lr=args.lr, max_epochs=args.max_epochs, depth=args.depth, width=args.width, stem=args.stem)
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
        print(f"ResNet-{args.depth} (width {args.width}): {n_params / 1e6:.2f}M parameters")
        print(strategy.layout.describe())
        print(f"final metrics: {metrics} (chance accuracy is {1 / NUM_CLASSES:.2f})")


if __name__ == "__main__":
    main()
