"""Stage boundaries that carry several tensors, on one GPU: Lightning's demo encoder-decoder and models that keep
block outputs or change the hidden state between blocks, two stages on one process (``devices=1``, a multi-stage
schedule) against the same model trained without the strategy, in fp32 and under ``bf16-mixed``.

    python benchmarks/gpu_boundaries.py          # prints one line per case; --accelerator cpu checks the script
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import zoo
from test_structure import Between, KeepsAll, SkipsOver

from lightning_pipe import PipelineStrategy


class DemoLM(L.LightningModule):
    """Lightning's demo ``Transformer`` (encoder, then decoder cross-attending to it), as its example trains it."""

    def __init__(self) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.model = Transformer(vocab_size=zoo.VOCAB, ninp=64, nhead=4, nhid=128, nlayers=2, dropout=0.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return F.nll_loss(self.model(x, y), y.view(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fitted(
    cls: type, strategy: Any, precision: str, accelerator: str
) -> tuple[list[float], dict[str, torch.Tensor], float]:
    torch.manual_seed(0)
    module, losses = cls(), []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, precision=precision, max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Losses()],
        gradient_clip_val=0.5, accumulate_grad_batches=2,
    )
    start = time.perf_counter()
    trainer.fit(module, zoo.loader("tokens", n=32, batch_size=4))
    return losses, {k: v.detach().float().cpu() for k, v in module.state_dict().items()}, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="gpu", choices=("gpu", "cpu"), help="cpu: check that the script runs")
    accelerator = p.parse_args().accelerator
    device = torch.cuda.get_device_name() if accelerator == "gpu" else "cpu"
    print(f"{device}, torch {torch.__version__}", flush=True)
    for cls in (DemoLM, KeepsAll, Between, SkipsOver):
        for precision in ("32-true", "bf16-mixed"):
            want = fitted(cls, "auto", precision, accelerator)
            for schedule in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"):
                strategy = PipelineStrategy(num_microbatches=2, schedule=schedule, stages_per_rank=2)
                got = fitted(cls, strategy, precision, accelerator)
                losses = max(abs(a - b) for a, b in zip(got[0], want[0]))
                weights = max((got[1][k] - want[1][k]).abs().max().item() for k in want[1])
                print(f"{cls.__name__:9s} {precision:10s} {schedule:22s} losses {losses:.1e} weights {weights:.1e}"
                      f" ({len(got[0])} steps, {got[2]:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
