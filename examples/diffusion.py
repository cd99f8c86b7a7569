"""Train a diffusion transformer (diffusers' Flux) with pipeline parallelism: the Lightning code is ordinary.

The model is ``diffusers``' own ``FluxTransformer2DModel``, built from a small config with random weights (nothing is
downloaded), trained by flow matching to produce 8x8 "images" (a colour per row and column, 4 latent channels)
from a text embedding. The only pipeline-specific line is ``strategy=PipelineStrategy(...)``: ``backbone="auto"``
finds the double-stream and the single-stream blocks, which the forward runs one after the other. Every block takes
``temb`` from the time and text embedders, and the double-stream blocks carry two states, the image's and the
text's: all of them cross the stage boundaries, and ``temb`` travels on to the final norm on the last stage (see
docs/models.md, "Diffusion transformers"). The log names what each stage boundary carries.

    python examples/diffusion.py                       # 2 CPU processes (gloo), or every GPU when CUDA exists
    python examples/diffusion.py --devices 4 --layers 4 --single-layers 4 --schedule ZBVZeroBubble

With the defaults each process needs well under a minute of CPU time and the validation loss (mean squared error of
the predicted velocity) falls from about 2.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from diffusers import FluxTransformer2DModel
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipe import SCHEDULE_NAMES, PipelineStrategy

SIDE, CHANNELS, TEXT, TEXT_DIM, POOLED = 8, 4, 4, 32, 16


class LitFlux(L.LightningModule):
    """diffusers' Flux in an ordinary LightningModule, trained by rectified flow (flow matching)."""

    def __init__(self, layers: int = 2, single_layers: int = 2, lr: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = FluxTransformer2DModel(
            patch_size=1, in_channels=CHANNELS, num_layers=layers, num_single_layers=single_layers,
            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=POOLED, axes_dims_rope=(4, 6, 6),
        )
        rows, cols = torch.meshgrid(torch.arange(SIDE), torch.arange(SIDE), indexing="ij")
        image_ids = torch.stack([torch.zeros(SIDE * SIDE), rows.flatten(), cols.flatten()], 1)
        self.register_buffer("img_ids", image_ids, persistent=False)
        self.register_buffer("txt_ids", torch.zeros(TEXT, 3), persistent=False)

    def velocity_loss(self, batch: Any) -> torch.Tensor:
        latents, text, pooled, t, noise = batch
        noisy = (1 - t[:, None, None]) * latents + t[:, None, None] * noise
        predicted = self.model(
            hidden_states=noisy, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
            img_ids=self.img_ids, txt_ids=self.txt_ids, return_dict=False,
        )[0]
        return F.mse_loss(predicted, noise - latents)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.velocity_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.velocity_loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def dataset(count: int, seed: int) -> TensorDataset:
    """Images whose latent is a colour per row plus a colour per column, captioned by a random projection of those
    colours; a timestep and the noise per image."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.randn(count, SIDE, 1, CHANNELS, generator=g), torch.randn(count, 1, SIDE, CHANNELS, generator=g)
    latents = (rows + cols).reshape(count, SIDE * SIDE, CHANNELS) / 2
    caption = torch.cat([rows.flatten(1), cols.flatten(1)], 1)
    projection = torch.randn(caption.shape[1], TEXT * TEXT_DIM, generator=torch.Generator().manual_seed(99))
    text = (caption @ projection / caption.shape[1] ** 0.5).reshape(count, TEXT, TEXT_DIM)
    pooled = text.mean(1)[:, :POOLED]
    t = torch.rand(count, generator=g)
    return TensorDataset(latents, text, pooled, t, torch.randn(latents.shape, generator=g))


def main(argv: Optional[list[str]] = None) -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if cuda else 2, help="processes")
    p.add_argument("--layers", type=int, default=2, help="double-stream blocks")
    p.add_argument("--single-layers", type=int, default=2, help="single-stream blocks")
    p.add_argument("--schedule", default="1F1B", choices=SCHEDULE_NAMES)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=60)
    args = p.parse_args(argv)
    L.seed_everything(1234)

    model = LitFlux(args.layers, args.single_layers)
    train = DataLoader(dataset(args.max_steps * args.batch_size, 0), batch_size=args.batch_size)
    val = DataLoader(dataset(4 * args.batch_size, 1), batch_size=args.batch_size)
    trainer = L.Trainer(
        accelerator="auto" if cuda else "cpu",
        devices=args.devices,
        strategy=PipelineStrategy(num_microbatches=args.num_microbatches, schedule=args.schedule),  # the one line
        max_steps=args.max_steps,
        val_check_interval=args.max_steps // 2,
        log_every_n_steps=10,
    )
    trainer.fit(model, train, val)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 3) for k, v in trainer.callback_metrics.items()}
        print(f"{trainer.strategy.layout.describe()}")
        print(f"final metrics: {metrics}")


if __name__ == "__main__":
    main()
