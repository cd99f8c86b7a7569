"""Fine-tune a Hugging Face encoder-decoder (T5) with pipeline parallelism: the Lightning code is ordinary.

The model is ``transformers``' own ``T5ForConditionalGeneration``, built from a small config with random weights
(nothing is downloaded), trained to reverse short byte strings. The batches are padded per batch, with ``-100``
where the target has no token, as a padding collator makes them. The only pipeline-specific line is
``strategy=PipelineStrategy(...)``: ``backbone="auto"`` finds the encoder's and the decoder's blocks, which the
forward runs one after the other, and splits them as one sequence. Where the decoder starts, that stage runs the
encoder's final norm and the decoder's embedding; the encoder's output travels with the decoder's hidden state to
every later stage, and T5's position bias to the stages that hold the rest of its stack (see docs/models.md,
"Encoder-decoders"). The log names what each stage boundary carries.

    python examples/seq2seq.py                         # 2 CPU processes (gloo), or every GPU when CUDA exists
    python examples/seq2seq.py --devices 4 --layers 4 --schedule InterleavedZeroBubble

With the defaults each process needs well under a minute of CPU time and the validation loss falls from about
ln(259) = 5.6.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import T5Config, T5ForConditionalGeneration

from lightning_pipe import SCHEDULE_NAMES, PipelineStrategy

PAD, EOS, OFFSET = 0, 1, 3  # byte b is token b + OFFSET


class LitSeq2Seq(L.LightningModule):
    """A ``transformers`` T5 in an ordinary LightningModule: the model computes its own loss from ``labels=``."""

    def __init__(self, layers: int = 2, dim: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = T5Config(
            vocab_size=256 + OFFSET, d_model=dim, d_kv=dim // 4, d_ff=4 * dim, num_layers=layers,
            num_decoder_layers=layers, num_heads=4, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=EOS,
            decoder_start_token_id=PAD,
        )
        self.model = T5ForConditionalGeneration(config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class Reversal(Dataset):
    """``count`` random byte strings of 4 to ``max_len`` bytes; the target is the string reversed."""

    def __init__(self, count: int, max_len: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(count):
            length = int(torch.randint(4, max_len + 1, (), generator=generator))
            source = torch.randint(ord("a"), ord("z") + 1, (length,), generator=generator) + OFFSET
            self.rows.append((source, source.flip(0)))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows[i]


def pad(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Pad to the longest row of the batch (plus the end token): inputs with ``PAD`` and a mask, labels with -100."""
    length = max(len(source) for source, _ in rows) + 1
    batch = {
        "input_ids": torch.full((len(rows), length), PAD),
        "attention_mask": torch.zeros(len(rows), length, dtype=torch.long),
        "labels": torch.full((len(rows), length), -100),
    }
    for i, (source, target) in enumerate(rows):
        batch["input_ids"][i, : len(source) + 1] = torch.cat([source, torch.tensor([EOS])])
        batch["attention_mask"][i, : len(source) + 1] = 1
        batch["labels"][i, : len(target) + 1] = torch.cat([target, torch.tensor([EOS])])
    return batch


def main(argv: Optional[list[str]] = None) -> None:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=torch.cuda.device_count() if cuda else 2, help="processes")
    p.add_argument("--layers", type=int, default=2, help="encoder layers (and as many decoder layers)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--schedule", default="1F1B", choices=SCHEDULE_NAMES)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-len", type=int, default=12)
    p.add_argument("--max-steps", type=int, default=60)
    args = p.parse_args(argv)
    L.seed_everything(1234)

    model = LitSeq2Seq(args.layers, args.dim)
    train = DataLoader(Reversal(args.max_steps * args.batch_size, args.max_len, 0), args.batch_size, collate_fn=pad)
    val = DataLoader(Reversal(4 * args.batch_size, args.max_len, 1), args.batch_size, collate_fn=pad)
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
