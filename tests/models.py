"""Small models and data shared by the tests; importable by the test processes and by pytest itself."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

VOCAB, DIM, SEQ = 32, 16, 8


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, dim: int = DIM, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)  # a key bias has a zero gradient: Adam would amplify noise
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(L.LightningModule):
    """Embedding, transformer blocks, norm and head in one ``nn.Sequential``, as in the package's contract."""

    def __init__(
        self,
        blocks: int = 4,
        lr: float = 0.1,
        optimizer: str = "sgd",
        scheduler: Optional[str] = None,
        batchnorm: bool = False,
        train_metric: bool = False,
        log_sometimes: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # a key logged on some steps only: the step's logs then travel as an object, the others as values
        self.log_sometimes = log_sometimes
        # a torchmetrics accuracy called (forward) in training_step, logged per step and per epoch
        self.train_acc = MulticlassAccuracy(num_classes=VOCAB, average="micro") if train_metric else None
        layers: list[nn.Module] = [nn.Embedding(VOCAB, DIM)]
        layers += [Block() for _ in range(blocks)]
        if batchnorm:
            layers.append(_SeqBatchNorm(DIM))
        layers += [nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)]
        self.backbone = nn.Sequential(*layers)
        self.step_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        if self.train_acc is not None:
            self.train_acc(logits.argmax(-1), y)
            self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_loss_epoch_sum", loss, on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)
        if self.log_sometimes and self.global_step % 3 == 1:
            self.log("train_loss_doubled", 2 * loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("val_loss", loss, sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if self.hparams.scheduler == "step":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.hparams.scheduler == "epoch":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        return opt


class FinetuneLM(L.LightningModule):
    """A feature extractor (``backbone``: embedding and blocks, as a pretrained model would be) under a neck of
    blocks and a head, the shape ``BackboneFinetuning`` expects. The pipeline runs the blocks of both
    (``backbone=["backbone.blocks", "neck"]``): with two stages, the first holds only the feature extractor.

    Args:
        optimize: ``"trainable"`` builds the optimizer over the parameters that require grad (``BaseFinetuning``'s
            documented pattern; empty on a stage that holds only frozen modules), ``"all"`` over every parameter.
    """

    def __init__(self, optimize: str = "trainable", lr: float = 0.02) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = nn.Module()
        self.backbone.embed = nn.Embedding(VOCAB, DIM)
        self.backbone.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.neck = nn.ModuleList([Block() for _ in range(2)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.backbone.embed(x)
        for block in self.backbone.blocks:
            h = block(h)
        for block in self.neck:
            h = block(h)
        return self.head(self.norm(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        params = self.parameters()
        if self.hparams.optimize == "trainable":
            params = filter(lambda p: p.requires_grad, params)
        return torch.optim.AdamW(params, lr=self.hparams.lr)


class _SeqBatchNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


def token_data(n: int = 48, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = torch.roll(x, -1, dims=1)
    return TensorDataset(x, y)


def loader(
    n: int = 48, batch_size: int = 8, seed: int = 0, drop_last: bool = False, shuffle: bool = False
) -> DataLoader:
    return DataLoader(token_data(n, seed), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)


class TokenData(L.LightningDataModule):
    """Random tokens; for the LightningCLI tests."""

    def __init__(self, n: int = 48, batch_size: int = 8) -> None:
        super().__init__()
        self.n, self.batch_size = n, batch_size

    def train_dataloader(self) -> DataLoader:
        return loader(self.n, self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return loader(16, self.batch_size, seed=1)


def make_model(seed: int = 1234, **kwargs: Any) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)
