"""``python -m lightning_pipe.consolidate CKPT_DIR OUT.ckpt``: one ordinary Lightning checkpoint file from a
lightning_pipe checkpoint directory.

Usage::

    python -m lightning_pipe.consolidate CKPT_DIR OUT.ckpt [--weights-only] [--overwrite] [--trusted]
    python -m lightning_pipe.consolidate CKPT_DIR OUT_DIR --format hf [--max-shard-size 5GB]
    lightning-pipe-consolidate CKPT_DIR OUT.ckpt

With ``--format hf`` it writes the Hugging Face model inside the LightningModule as a directory ``from_pretrained``
loads (safetensors files, ``model.safetensors.index.json``, ``config.json``), holding one output file's tensors at a
time.

It runs in one process, needs no GPU and no process group, and reads the shards of every rank. The file it
writes is what single-device training would have saved: ``Model.load_from_checkpoint(OUT.ckpt)`` loads it without
any strategy, and ``Trainer(...).fit(model, ckpt_path=OUT.ckpt)`` resumes from it on any strategy. From Python:
:func:`~lightning_pipe.checkpoint.consolidated_checkpoint` returns the same dictionary without writing it.

The directory is read without running code from it: a file that holds anything else than tensors, plain
containers and DCP's index is refused (exit status 1, naming the file), unless ``--trusted`` is given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from lightning_pipe.checkpoint import consolidate, consolidated_checkpoint
from lightning_pipe.checkpoint._consolidate import write_file
from lightning_pipe.checkpoint._hf import convert_checkpoint
from lightning_pipe.checkpoint._safe import DamagedCheckpointError, UnsafeCheckpointError

__all__ = ["consolidate", "consolidated_checkpoint", "main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    parser = argparse.ArgumentParser(
        prog=script if script.startswith("lightning-pipe-consolidate") else "python -m lightning_pipe.consolidate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Consolidate a lightning_pipe (PipelineStrategy) checkpoint directory into one ordinary Lightning\n"
            "checkpoint file. The directory was written with torch.distributed.checkpoint by every pipeline rank,\n"
            "each saving its own stages; this reads all of them in a single process on CPU (no GPU, no process\n"
            "group, any number of ranks at save time).\n\n"
            "The output is what single-device training would have saved: the whole model's state_dict under its\n"
            "original parameter names, hyper_parameters, epoch, global_step, loops, callbacks, LR schedulers and\n"
            "the optimizer states in torch.optim format. So `MyModel.load_from_checkpoint(OUT)` loads it without\n"
            "any strategy, and `trainer.fit(model, ckpt_path=OUT)` resumes from it on any strategy."
        ),
        epilog=(
            "examples:\n"
            "  python -m lightning_pipe.consolidate lightning_logs/version_0/checkpoints/last.ckpt model.ckpt\n"
            "  lightning-pipe-consolidate 'checkpoints/epoch=9-step=1000.ckpt' weights.ckpt --weights-only"
        ),
    )
    parser.add_argument(
        "checkpoint_dir",
        metavar="CKPT_DIR",
        help="checkpoint directory written by PipelineStrategy (e.g. .../last.ckpt)",
    )
    parser.add_argument("output", metavar="OUT.ckpt", help="path of the single checkpoint file to write")
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="leave out optimizer, LR scheduler and callback states (like ModelCheckpoint(save_weights_only=True))",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT.ckpt if it exists")
    parser.add_argument(
        "--format", choices=("lightning", "hf"), default="lightning",
        help="lightning: one Lightning checkpoint file (default); hf: a Hugging Face directory (OUT is a directory)",
    )
    parser.add_argument("--max-shard-size", default="5GB", help="with --format hf: the largest safetensors file")
    parser.add_argument(
        "--trusted",
        action="store_true",
        help="the checkpoint comes from a source you trust: unpickle its files without restrictions (like"
        " torch.load(weights_only=False)), which runs any code they hold. Without it nothing from them runs, and a"
        " file holding objects of other classes than tensors and plain containers is refused",
    )
    args = parser.parse_args(argv)
    out = Path(args.output)
    if out.exists() and not args.overwrite:
        parser.error(f"`{out}` exists; pass --overwrite to replace it.")
    if args.format == "hf":
        try:
            written = convert_checkpoint(
                args.checkpoint_dir, out, max_shard_size=args.max_shard_size, trusted=args.trusted
            )
        except (FileNotFoundError, ValueError) as err:
            parser.error(str(err))
        except (UnsafeCheckpointError, DamagedCheckpointError) as err:
            parser.exit(1, f"{parser.prog}: error: {err}\n")
        print(f"Wrote the Hugging Face directory {written}.")
        return 0
    try:
        checkpoint = consolidated_checkpoint(args.checkpoint_dir, weights_only=args.weights_only, trusted=args.trusted)
    except FileNotFoundError as err:
        parser.error(str(err))
    except (UnsafeCheckpointError, DamagedCheckpointError) as err:
        parser.exit(1, f"{parser.prog}: error: {err}\n")
    write_file(checkpoint, out)
    tensors = checkpoint["state_dict"]
    numel = sum(t.numel() for t in tensors.values() if isinstance(t, torch.Tensor))
    print(
        f"Wrote {out}: {len(tensors)} tensors ({numel:,} values), epoch={checkpoint.get('epoch')},"
        f" global_step={checkpoint.get('global_step')},"
        f" optimizer states: {len(checkpoint.get('optimizer_states', []))}."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
