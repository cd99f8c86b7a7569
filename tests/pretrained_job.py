"""Phases of ``test_pretrained.py``: a Hugging Face model fine-tuned under the pipeline leaves the run whole.

Each phase fits a model from ``zoo.py`` (or a peft LoRA around one), then does what a user's script does after ``fit``:
``lit.model.save_pretrained`` and ``torch.save(lit.state_dict())`` on global zero and a plain forward, the parallel
save (``PipelineStrategy.save_pretrained``, the ``HuggingFaceCheckpoint`` callback) and ``trainer.save_checkpoint``.
With ``keep_split`` the module stays split and those reads must fail, naming the parallel save.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
import zoo
import zoo_job

from lightning_pipe import HuggingFaceCheckpoint, PipelineStrategy, SplitModuleError, read_pretrained


def lora(model: L.LightningModule) -> L.LightningModule:
    from peft import LoraConfig, get_peft_model

    model.model = get_peft_model(model.model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def run_phase(phase: dict[str, Any], devices: int) -> dict[str, Any]:
    out = Path(phase["out"])
    if phase.get("pretrained"):  # built on the meta device, each rank reading its stages from the directory
        with torch.device("meta"):
            model = zoo.make(phase["model"])
        read_pretrained(model.model, phase["pretrained"])
    else:
        model = zoo.make(phase["model"])
    if phase.get("lora"):
        torch.manual_seed(7)
        model = lora(model)
    pipelined = phase.get("strategy") is not None
    strategy = PipelineStrategy(**phase["strategy"]) if pipelined else "auto"
    wanted = phase.get("callback") and pipelined
    saving = [HuggingFaceCheckpoint(out / "callback", every_n_train_steps=2)] if wanted else []
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        max_epochs=1, gradient_clip_val=0.5,
        callbacks=saving,
    )
    trainer.fit(model, zoo.loader(phase["model"], n=32, batch_size=8))
    result: dict[str, Any] = {"rank": trainer.global_rank, "refused": None}
    x = zoo.tokens(8, seed=3).tensors[0]
    if phase.get("keep_split"):
        try:
            model.model.save_pretrained(out / f"refused{trainer.global_rank}")
        except SplitModuleError as err:
            result["refused"] = str(err)
        result["written"] = sorted(p.name for p in (out / f"refused{trainer.global_rank}").glob("*"))
    elif trainer.is_global_zero:
        model.model.save_pretrained(out / "plain")
        result["state_dict"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            result["logits"] = model.model(input_ids=x).logits
    if isinstance(trainer.strategy, PipelineStrategy):
        trainer.strategy.save_pretrained(out / "parallel")
        if not phase.get("lora"):
            trainer.save_checkpoint(out / "trained.ckpt")
    return result


if __name__ == "__main__":
    try:
        zoo_job.main(sys.argv[1], sys.argv[2], run=run_phase)
    except BaseException:
        traceback.print_exc()
        raise
