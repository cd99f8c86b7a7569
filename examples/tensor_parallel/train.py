# Lightning's examples/pytorch/tensor_parallel/train.py (README.md names the commit), with only these changes,
# each marked "CHANGED" below, so that it runs under lightning_pipe's PipelineStrategy on a CPU:
# - the strategy: PipelineStrategy(pipeline_parallel_size=2, tensor_parallel_size=2) in place of
#   ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), which stays behind `--strategy model_parallel`
#   for comparison; `--data-parallel-size` sets the replicas of either (devices = 4 or 2 per replica);
# - a CPU-sized model and data: ModelArgs(dim=64, n_layers=4, n_heads=4, vocab_size=256, multiple_of=32,
#   max_seq_len=32), sequences of 32 tokens, num_workers=0;
# - accelerator="cpu" on 4 processes in place of 4 GPUs (no CUDA check).
#
#     python train.py                                                   # pp2 x tp2, 4 processes
#     python train.py --data-parallel-size 2                            # pp2 x dp2 x tp2 (fully_shard), 8 processes
#     python train.py --strategy model_parallel --data-parallel-size 2  # Lightning's own, as published, 4 processes
# Lightning's import order is kept as published:
# ruff: noqa: I001
import argparse  # CHANGED

import torch
import torch.nn.functional as F
from data import RandomTokenDataset
from model import ModelArgs, Transformer
from parallelism import parallelize
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader

import lightning as L
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_pipe import PipelineStrategy  # CHANGED


class Llama3(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model_args = ModelArgs(  # CHANGED: CPU-sized
            dim=64, n_layers=4, n_heads=4, vocab_size=256, multiple_of=32, max_seq_len=32
        )
        self.model = Transformer(self.model_args)

    def configure_model(self):
        # User-defined function that applies the desired parallelizations specific to the model
        # (TP, FSDP2, activation checkpointing, ...)
        parallelize(self.model, device_mesh=self.device_mesh)

    def on_train_start(self) -> None:
        self.model.init_weights()

    def training_step(self, batch):
        inputs = batch[:, :-1]
        labels = batch[:, 1:]
        output = self.model(inputs)
        # Optional: Parallelize loss computation across class dimension (see parallelism.py)
        with loss_parallel():
            return F.cross_entropy(output.reshape(-1, output.size(-1)), labels.reshape(-1))

    def backward(self, *args, **kwargs):
        with loss_parallel():
            super().backward(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=True)

    def train_dataloader(self):
        dataset = RandomTokenDataset(vocab_size=self.model_args.vocab_size, seq_length=32)  # CHANGED: 32
        # Trainer configures the sampler automatically for you such that
        # all batches in a tensor-parallel group are identical
        return DataLoader(dataset, batch_size=8, num_workers=0)  # CHANGED: 0


def train(strategy_name="pipeline", data_parallel_size=1):  # CHANGED: arguments
    if strategy_name == "model_parallel":  # CHANGED: Lightning's own, for comparison
        strategy = ModelParallelStrategy(
            # Define the size of the 2D parallelism
            # Set to "auto" to apply TP intra-node and DP inter-node
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=2,
        )
    else:
        strategy = PipelineStrategy(pipeline_parallel_size=2, tensor_parallel_size=2)  # CHANGED

    trainer = L.Trainer(
        accelerator="cpu",  # CHANGED
        devices=data_parallel_size * (2 if strategy_name == "model_parallel" else 4),  # CHANGED: 4 by default
        strategy=strategy,
        limit_train_batches=10,
        max_epochs=1,
    )

    # Initialize the model
    with trainer.init_module(empty_init=True):
        model = Llama3()

    trainer.print(f"Number of model parameters: {sum(p.numel() for p in model.parameters()) / 1e9:.1f} B")
    trainer.print("Starting training ...")

    trainer.fit(model)

    trainer.print("Training successfully completed!")
    trainer.print(f"Peak memory usage: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()  # CHANGED: picks the strategy, in place of the CUDA check
    parser.add_argument("--strategy", choices=["pipeline", "model_parallel"], default="pipeline")
    parser.add_argument("--data-parallel-size", type=int, default=1)
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")
    train(args.strategy, args.data_parallel_size)
