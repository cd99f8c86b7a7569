"""Turn a lightning_pipe checkpoint directory into one ordinary Lightning checkpoint file.

Usage::

    python -m lightning_pipe.consolidate CKPT_DIR OUT.ckpt [--weights-only] [--overwrite]
    lightning-pipe-consolidate CKPT_DIR OUT.ckpt

It runs in one process, needs no GPU and no process group, and reads the shards of every rank. The file it
writes is what single-device training would have saved: ``state_dict`` with every parameter and buffer under its
original name, the optimizer states in ``torch.optim`` format (``optimizer_states``), the LR schedulers, loops,
callbacks, hyper-parameters, ``epoch`` and ``global_step``. ``Model.load_from_checkpoint(OUT.ckpt)`` loads it
without any strategy, and ``Trainer(...).fit(model, ckpt_path=OUT.ckpt)`` resumes from it on any strategy.

From Python: :func:`consolidated_checkpoint` returns the same dictionary without writing it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp

from lightning_pipe.checkpoint import INFO_KEY, META_FILENAME, is_pipeline_checkpoint

__all__ = ["consolidate", "consolidated_checkpoint", "main"]

# What Lightning leaves out of a `save_weights_only` checkpoint.
_TRAINING_STATE_KEYS = ("optimizer_states", "lr_schedulers", "callbacks")


def consolidated_checkpoint(checkpoint_dir: Any, weights_only: bool = False) -> dict[str, Any]:
    """Read a lightning_pipe checkpoint directory into one ordinary Lightning checkpoint dictionary.

    Args:
        checkpoint_dir: the directory ``ModelCheckpoint`` or ``trainer.save_checkpoint`` wrote.
        weights_only: leave out the optimizer, LR scheduler and callback states, as
            ``ModelCheckpoint(save_weights_only=True)`` does.
    """
    path = Path(checkpoint_dir)
    if not is_pipeline_checkpoint(path):
        raise FileNotFoundError(
            f"`{path}` is not a complete lightning_pipe checkpoint directory (it needs `{META_FILENAME}` and DCP's"
            " `.metadata`)."
        )
    checkpoint = torch.load(path / META_FILENAME, map_location="cpu", weights_only=False)
    info = checkpoint.pop(INFO_KEY, None) or {}
    checkpoint.pop("pipeline_layout", None)
    stored = _read_all(path, keys={"state_dict"} if weights_only else None)
    weights = stored.pop("state_dict", {})
    order = [k for k in info.get("state_dict_keys", []) if k in weights]
    order += [k for k in weights if k not in set(order)]
    checkpoint["state_dict"] = OrderedDict((k, weights[k]) for k in order)
    optimizers = info.get("optimizers", [])
    if "lr_schedulers" in checkpoint and optimizers:  # the save held training state (not weights only)
        checkpoint["optimizer_states"] = [
            _optimizer_state(stored.get(f"optimizer_{idx}", {}), opt["param_groups"])
            for idx, opt in enumerate(optimizers)
        ]
    if weights_only:
        for key in _TRAINING_STATE_KEYS:
            checkpoint.pop(key, None)
    return checkpoint


def consolidate(checkpoint_dir: Any, output: Any, weights_only: bool = False, overwrite: bool = False) -> Path:
    """Write :func:`consolidated_checkpoint` of ``checkpoint_dir`` to the file ``output``; return its path."""
    out = Path(output)
    if out.exists() and not overwrite:
        raise FileExistsError(f"`{out}` exists; pass `--overwrite` (or `overwrite=True`) to replace it.")
    _write(consolidated_checkpoint(checkpoint_dir, weights_only=weights_only), out)
    return out


def _write(checkpoint: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, out)


def _read_all(path: Path, keys: Optional[set[str]] = None) -> dict[str, Any]:
    """The entries of a DCP checkpoint (all, or those under ``keys``), read in this process alone (no process group)."""
    state: dict[str, Any] = {}
    try:
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    except ImportError:  # pragma: no cover - a torch without these private names: go through a file
        import tempfile

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(path, Path(tmp) / "all.pt")
            return torch.load(Path(tmp) / "all.pt", map_location="cpu", weights_only=False)
    _load_state_dict(
        state, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True
    )
    return state


def _optimizer_state(flat: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """A ``torch.optim.Optimizer.state_dict()`` from the flattened, name-keyed state DCP holds.

    ``groups`` lists each parameter group's names in the single-device order, so parameter ``i`` of the result is
    the ``i``-th name over all groups, as ``optimizer.load_state_dict`` expects.
    """
    names = {name for group in groups for name in group}
    per_name: dict[str, dict[str, dict[str, Any]]] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        name, sub = _split_name(rest, names)
        if name is None or section not in ("state", "param_groups"):
            continue
        keys = sub.split(".") if section == "state" else [sub]
        _set_nested(per_name.setdefault(name, {}).setdefault(section, {}), keys, value)
    state: dict[int, Any] = {}
    param_groups = []
    number = 0
    for group_names in groups:
        hyper: Optional[dict[str, Any]] = None
        numbers = []
        for name in group_names:
            entry = per_name.get(name, {})
            if entry.get("state"):
                state[number] = entry["state"]
            if hyper is None and entry.get("param_groups"):
                hyper = dict(entry["param_groups"])
            numbers.append(number)
            number += 1
        group = hyper or {}
        if "param_names" in group:
            group["param_names"] = list(group_names)
        group["params"] = numbers
        param_groups.append(group)
    return {"state": state, "param_groups": param_groups}


def _split_name(rest: str, names: set[str]) -> tuple[Optional[str], str]:
    """Split ``"<parameter name>.<key>"`` at the dot that leaves a known parameter name on the left."""
    pos = rest.rfind(".")
    while pos > 0:
        if rest[:pos] in names:
            return rest[:pos], rest[pos + 1 :]
        pos = rest.rfind(".", 0, pos)
    return None, rest


def _set_nested(target: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


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
        "checkpoint_dir", metavar="CKPT_DIR", help="checkpoint directory written by PipelineStrategy (e.g. .../last.ckpt)"
    )
    parser.add_argument("output", metavar="OUT.ckpt", help="path of the single checkpoint file to write")
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="leave out optimizer, LR scheduler and callback states (like ModelCheckpoint(save_weights_only=True))",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT.ckpt if it exists")
    args = parser.parse_args(argv)
    out = Path(args.output)
    if out.exists() and not args.overwrite:
        parser.error(f"`{out}` exists; pass --overwrite to replace it.")
    try:
        checkpoint = consolidated_checkpoint(args.checkpoint_dir, weights_only=args.weights_only)
    except FileNotFoundError as err:
        parser.error(str(err))
    _write(checkpoint, out)
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
