"""Lightning's ``examples/pytorch/fp8_distributed_transformer`` on the CPU, for ``tests/tp_example_job.py``.

The example's ``LanguageModel`` as published, but for what a CPU and CI allow: no float8 conversion (torchao is not
installed, and float8 needs a recent GPU), a tiny ``Transformer`` (the example's 16 layers of 1024 features are two
encoder and two decoder layers of 16 here) with dropout 0 (the example's default 0.2 draws other random numbers under
a pipeline), a few batches of random tokens in place of WikiText2 (which downloads), and ``torch.compile`` with the
``aot_eager`` backend (AOTAutograd's graphs run eagerly: inductor's C++ compile would take minutes on CI's two
cores). It keeps the rest: ``fully_shard`` of every encoder and decoder layer and of the root with
``self.device_mesh`` (the whole mesh, as the example passes it), ``torch.compile`` of the sharded model in
``configure_model``, ``training_step(self, batch)`` without ``batch_idx``, Adam, batches of one sample,
``accumulate_grad_batches`` and the precision (``bf16-true`` as published, or ``32-true``).

Every run starts from the same full weights (:func:`full_weights`, loaded in ``on_train_start`` into whatever this
rank holds) and counts the graphs dynamo compiled, so a test can tell that the compiled module ran compiled.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import plain
from lightning.pytorch.demos import Transformer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed._composable.fsdp.fully_shard import fully_shard  # as the example imports it
from torch.utils.data import DataLoader, Dataset
from tp_example_job import load_full

from lightning_pipe import PipelineStrategy

VOCAB, SEQ, BATCHES, ACCUMULATE = 64, 8, 4, 2
SEED = 4321
#: Graphs dynamo handed to the backend in this process.
GRAPHS: list[int] = []


def counting_aot_eager(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """``backend="aot_eager"``, counting the graphs it is given."""
    from torch._dynamo.backends.registry import lookup_backend

    GRAPHS.append(len(gm.graph.nodes))
    return lookup_backend("aot_eager")(gm, example_inputs)


def transformer() -> Transformer:
    return Transformer(vocab_size=VOCAB, nlayers=2, nhid=32, ninp=16, nhead=2, dropout=0.0)


@functools.cache
def full_weights() -> dict[str, torch.Tensor]:
    """The model built whole from a fixed seed, under the names the LightningModule gives it (``model._orig_mod.``)."""
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = transformer()
    return {f"model._orig_mod.{k}": v.detach().clone() for k, v in model.state_dict().items()}


class Tokens(Dataset):
    def __len__(self) -> int:
        return BATCHES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(i))
        return x[:-1], x[1:]


class LanguageModel(L.LightningModule):
    """The example's module (float8 aside); on one process without a strategy there is no mesh to shard over."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.model: Optional[nn.Module] = None
        self.initial: Optional[dict[str, torch.Tensor]] = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):
            model = transformer()
        if self.device_mesh is not None:
            for module in model.modules():
                if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
                    fully_shard(module, mesh=self.device_mesh)
            fully_shard(model, mesh=self.device_mesh)
        else:  # one process, no strategy: built on the device
            model = model.to_empty(device="cpu")
        self.model = torch.compile(model, backend=counting_aot_eager)

    def training_step(self, batch):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def on_train_start(self) -> None:
        load_full(self, full_weights())
        self.initial = plain(self.state_dict())


def run_phase(phase: dict[str, Any], devices: int, recorder: L.Callback) -> dict[str, Any]:
    """Train the example under ``phase["strategy"]`` (``"pipeline"``, ``"model_parallel"`` or null: one process)."""
    kind, kwargs = phase.get("strategy"), phase.get("strategy_kwargs", {})
    strategy = {"pipeline": PipelineStrategy, "model_parallel": ModelParallelStrategy}[kind](**kwargs) if kind \
        else "auto"
    GRAPHS.clear()
    torch.compiler.reset()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices if kind else 1, strategy=strategy, precision=phase["precision"],
        max_steps=BATCHES // ACCUMULATE, accumulate_grad_batches=ACCUMULATE, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[recorder],
    )
    model = LanguageModel(vocab_size=VOCAB)
    trainer.fit(model, DataLoader(Tokens(), batch_size=1))
    return {
        "error": None,
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "steps": recorder.steps,
        "initial": model.initial,
        "state_dict": plain(model.state_dict()),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "graphs": len(GRAPHS),
    }
