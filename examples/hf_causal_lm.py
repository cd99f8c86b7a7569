"""Train a Hugging Face ``transformers`` causal LM with pipeline parallelism: the Lightning code is ordinary.

The model is ``transformers``' own ``LlamaForCausalLM`` (or ``GPT2LMHeadModel``, whose head is tied to its token
embedding), built from a small config with random weights: nothing is downloaded. The LightningModule holds it as
``self.model`` and calls it as anyone would, with ``labels=`` so that the model computes its own loss. The only
pipeline-specific line is ``strategy=PipelineStrategy(...)``: the strategy finds the decoder layers
(``model.model.layers``, an ``nn.ModuleList`` the model loops over), gives every layer its mask and rotary tables
on whichever process runs it, keeps the embedding on the first stage and the final norm, head and loss on the last,
and keeps the model's parameter names, so a consolidated checkpoint loads straight into ``LlamaForCausalLM``.

    python examples/hf_causal_lm.py                        # 2 CPU processes (gloo), or every GPU when CUDA exists
    python examples/hf_causal_lm.py --family gpt2          # GPT-2: the tied head lives on both end stages
    python examples/hf_causal_lm.py --devices 4 --layers 8 --schedule Interleaved1F1B

The data is the bytes of Python's own standard library (vocabulary 256), cut into random windows. With the defaults
each process needs well under a minute of CPU time and the validation loss falls from about ln(256) = 5.5.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from lightning_pipe import SCHEDULE_NAMES, PipelineStrategy


class LitCausalLM(L.LightningModule):
    """A ``transformers`` causal LM in an ordinary LightningModule."""

    def __init__(self, family: str = "llama", layers: int = 4, dim: int = 128, lr: float = 2e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        if family == "llama":
            config = LlamaConfig(
                vocab_size=256, hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            )
            self.model = LlamaForCausalLM(config)
        else:
            config = GPT2Config(vocab_size=256, n_embd=dim, n_layer=layers, n_head=4, n_positions=512)
            self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch, labels=batch).loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)


class Windows(Dataset):
    """``count`` random windows of ``seq_len`` bytes of Python's standard library (part ``split`` of it)."""

    def __init__(self, seq_len: int, count: int, split: str, seed: int = 0) -> None:
        root = os.path.dirname(os.__file__)
        data = b"".join(Path(p).read_bytes() for p in sorted(glob.glob(os.path.join(root, "*.py")))[:40])
        cut = int(0.9 * len(data))
        data = data[:cut] if split == "train" else data[cut:]
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq_len = seq_len
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.data) - seq_len, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.starts[i])
        return self.data[start : start + self.seq_len].long()


def main(argv: Optional[list[str]] = None) -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if cuda else 2, help="processes")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--schedule", default="1F1B", choices=SCHEDULE_NAMES)
    p.add_argument("--num-microbatches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=40)
    args = p.parse_args(argv)
    L.seed_everything(1234)

    model = LitCausalLM(args.family, args.layers, args.dim)
    train = DataLoader(Windows(args.seq_len, args.max_steps * args.batch_size, "train"), batch_size=args.batch_size)
    val = DataLoader(Windows(args.seq_len, 4 * args.batch_size, "val", seed=1), batch_size=args.batch_size)
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
        print(f"final metrics: {metrics} (a uniform guess scores ln(256) = {math.log(256):.2f})")


if __name__ == "__main__":
    main()
