"""The planner's command line: ``python -m lightning_pipe.plan --config cfg.yaml`` recommends a
``PipelineStrategy`` configuration for a LightningCLI config file.

It builds the config's model (on the meta device when that works), measures its backbone with
:func:`~lightning_pipe.plan.backbone_profile`, ranks the plans with :func:`~lightning_pipe.plan.search_plans`
and prints the best ones, then the ``PipelineStrategy(...)`` call and the YAML lines that run the best. :func:`main`
is the entry point; ``lightning_pipe/plan.py`` calls it when run as a script.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

from lightning_pipe._bytes import format_bytes, parse_bytes
from lightning_pipe.plan._model import backbone_profile
from lightning_pipe.plan._result import Plan
from lightning_pipe.plan._search import PLANNED_SCHEDULES, search_plans

if TYPE_CHECKING:
    from torch import nn

_DESCRIPTION = """\
Recommend a PipelineStrategy configuration for a LightningCLI config file.

Reads the config's `model` (class_path + init_args), builds the model on the meta device (nothing is allocated or
computed), measures the backbone's parameters per module and, with --input-shape, the activations it keeps for
backward, then ranks every pipeline size (dividing the device count), schedule (all seven, each played in torch's
own order of actions) and microbatch count by predicted step time among the plans that fit --memory-budget. Prints
the best plans and the PipelineStrategy(...) call / YAML lines for the best one.

The batch: --batch-size, else the config's data.init_args.batch_size, is the per-process dataloader batch as
in the config; the global batch (what plans are compared at) is that times the config's current number of
replicas (its trainer.strategy's data_parallel_size; every process for a non-pipeline strategy such as DDP; 1 for
PipelineStrategy's default of one pipeline over all devices). --global-batch-size sets it directly.

Costs are parameter counts unless --costs gives measured forward+backward times per sample, one per backbone
module, or --measure times them on this machine (forward, input and weight gradient apart). Predicted times are
relative unless measured: compare plans, not seconds. See docs/planner.md for the model.

With --max-tensor-parallel T, tensor-parallel sizes up to T (powers of two dividing the devices per node and
--tensor-divisor, e.g. the attention head count) are considered too.
"""

_EPILOG = """\
example:
  python -m lightning_pipe.plan --config config.yaml --devices 8 --memory-budget 40GiB --input-shape 2048 \\
      --input-dtype long
"""


def _build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_pipe.plan",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", required=True, help="LightningCLI YAML with `model` (and optionally `data`, `trainer`)."
    )
    parser.add_argument("--devices", type=int, help="devices per node (default: the config's trainer.devices).")
    parser.add_argument("--num-nodes", type=int, help="nodes (default: the config's trainer.num_nodes, else 1).")
    parser.add_argument(
        "--batch-size", type=int, help="per-process dataloader batch (default: data.init_args.batch_size)."
    )
    parser.add_argument("--global-batch-size", type=int, help="samples per optimizer step over all replicas.")
    parser.add_argument("--memory-budget", help="bytes one device may use, e.g. 16GiB, 80GB, 1e10.")
    parser.add_argument("--pipeline-parallel-size", type=int, help="consider only this pipeline size.")
    parser.add_argument(
        "--backbone",
        help="the backbone's container, a dotted path (default: the config's strategy backbone, else 'auto').",
    )
    parser.add_argument(
        "--costs",
        default="parameters",
        help="'parameters' (default), or forward+backward times per sample, one per module: '1.0,2.5,...' or a"
        " JSON file.",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="time each module's forward, input gradient and weight gradient on this machine (needs --input-shape, the"
        " backbone's input; the model runs with random weights) and plan with those times, the split of each"
        " included: predicted step times are then in seconds.",
    )
    parser.add_argument("--measure-device", default="cpu", help="where --measure runs the modules (cpu, cuda).")
    parser.add_argument("--measure-batch", type=int, default=4, help="samples per timed call of --measure.")
    parser.add_argument(
        "--cost-split",
        default="1,1,1",
        help="forward, input-gradient and weight-gradient shares of each module's cost (default equal; --measure"
        " measures them).",
    )
    parser.add_argument(
        "--transfer-time", type=float, default=0.0,
        help="time of sending one sample's activation between stages, in the units of the costs (seconds with"
        " --measure); 0: free.",
    )
    parser.add_argument(
        "--data-parallel-time-per-byte", type=float, default=0.0,
        help="time of the replicas' gradient all-reduce per byte (ring), in the units of the costs; 0: free.",
    )
    parser.add_argument(
        "--input-shape",
        help="per-sample shape of the backbone input, e.g. '2048' or '3,224,224': measures activations on the meta"
        " device.",
    )
    parser.add_argument("--input-dtype", default="float32", help="dtype of that input (e.g. long for token ids).")
    parser.add_argument(
        "--bytes-per-parameter", type=float, help="override the parameters' element size (2 for bf16-true)."
    )
    parser.add_argument(
        "--optimizer-multiplier",
        type=float,
        default=3.0,
        help="gradient + optimizer copies of the weights (Adam: 3, SGD+momentum: 2).",
    )
    parser.add_argument(
        "--microbatch-overhead",
        type=float,
        default=0.01,
        help="cost per microbatch and stage, as a fraction of the ideal step time.",
    )
    parser.add_argument(
        "--schedules", default=",".join(PLANNED_SCHEDULES), help="comma-separated schedules to consider."
    )
    parser.add_argument(
        "--max-tensor-parallel",
        type=int,
        default=1,
        help="consider tensor-parallel sizes up to this, inside a node (default 1: no tensor parallelism).",
    )
    parser.add_argument(
        "--tensor-divisor", type=int, help="a number every tensor-parallel size must divide (the attention heads)."
    )
    parser.add_argument(
        "--tensor-parallel-overhead",
        type=float,
        default=0.1,
        help="tensor-parallel communication, as a fraction of a module's cost times (T-1)/T.",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="the tensor-parallel plan shards activations along the sequence: each tensor rank keeps 1/T of them.",
    )
    parser.add_argument("--model-class", help="class path of the model when the config's `model` has no class_path.")
    parser.add_argument(
        "--top",
        type=int,
        default=8,
        help="how many plans to list (the best per pipeline size, tensor-parallel size and schedule).",
    )
    return parser


def _load_config(path: str) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise SystemExit(f"error: {path} does not hold a mapping.")
    if "fit" in config and "model" not in config and isinstance(config["fit"], dict):
        config = config["fit"]  # a `python main.py --config` file written for the fit subcommand
    return config


def _instantiate_model(model_config: Any, model_class: Optional[str]) -> tuple[nn.Module, bool]:
    """Build the model from ``{class_path, init_args}`` with jsonargparse; on the meta device when that works."""
    import torch
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    if isinstance(model_config, str):
        model_config = {"class_path": model_config}
    if not isinstance(model_config, dict):
        raise SystemExit("error: the config's `model` must be a mapping with `class_path` and `init_args`.")
    if "class_path" not in model_config:
        if not model_class:
            raise SystemExit(
                "error: the config's `model` has no `class_path` (the script fixes the model class);"
                " give it with --model-class package.module.ClassName."
            )
        model_config = {"class_path": model_class, "init_args": model_config}
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model", required=True)
    cfg = parser.parse_object({"model": model_config})
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    try:
        with torch.device("meta"):
            model = instantiate(cfg).model
        on_meta = True
    except Exception as error:  # e.g. __init__ loads weights or calls .item(): build it for real
        print(
            f"note: building the model on the meta device failed ({type(error).__name__}: {error});"
            " building it on the CPU instead.",
            file=sys.stderr,
        )
        model = instantiate(cfg).model
        on_meta = False
    return model, on_meta


def _devices(trainer: dict[str, Any], devices: Optional[int], num_nodes: Optional[int]) -> tuple[int, int]:
    """``(devices per node, devices in all)``."""
    if devices is None:
        value = trainer.get("devices")
        if isinstance(value, (list, tuple)):
            devices = len(value)
        elif isinstance(value, str) and value.strip().isdigit():
            devices = int(value)
        elif isinstance(value, int) and value > 0:
            devices = value
        else:
            raise SystemExit(f"error: cannot tell the device count from trainer.devices={value!r}; give --devices N.")
    nodes = num_nodes if num_nodes is not None else int(trainer.get("num_nodes") or 1)
    return devices, devices * nodes


def _current_replicas(strategy: Any, devices: int) -> int:
    """How many replicas the config trains with now: the divisor from per-process batch to global batch."""
    if strategy is None or strategy in ("auto", "single_device"):
        return devices if devices > 1 else 1
    if isinstance(strategy, str):
        return 1 if strategy.startswith("pipeline") else devices
    if isinstance(strategy, dict):
        if "PipelineStrategy" not in str(strategy.get("class_path", "")):
            return devices
        init = strategy.get("init_args") or {}
        dp, pp = init.get("data_parallel_size", "auto"), init.get("pipeline_parallel_size", "auto")
        if isinstance(dp, int):
            return dp
        if isinstance(pp, int) and pp > 0:
            return max(1, devices // pp)
        return 1
    return devices


def _parse_costs(text: str) -> Union[str, list[float]]:
    import json
    import os

    if text == "parameters":
        return text
    if os.path.exists(text):
        with open(text) as f:
            values = json.load(f)
    else:
        values = [float(x) for x in text.replace(" ", "").split(",") if x]
    return [float(x) for x in values]


def _table(plans: Sequence[Plan]) -> str:
    best = plans[0].predicted_step_time
    tensor = any(plan.tensor_parallel_size > 1 for plan in plans)  # the column only when it says something
    header = [
        "pp",
        "dp",
        *(["tp"] if tensor else []),
        "schedule",
        "v",
        "micro",
        "mb size",
        "bubble",
        "rel. time",
        "ideal/time",
        "memory/device",
        "modules per stage",
    ]
    rows = []
    for plan in plans:
        memory = "-" if plan.predicted_memory_per_device is None else format_bytes(plan.predicted_memory_per_device)
        rows.append(
            [
                str(plan.pipeline_parallel_size),
                str(plan.data_parallel_size),
                *([str(plan.tensor_parallel_size)] if tensor else []),
                plan.schedule,
                str(plan.stages_per_rank),
                str(plan.num_microbatches),
                str(plan.microbatch_size),
                f"{plan.predicted_bubble:.1%}",
                f"{plan.predicted_step_time / best:.3f}",
                f"{plan.efficiency:.0%}",
                memory,
                str(list(plan.balance)),
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _build_arg_parser().parse_args(argv)
    config = _load_config(args.config)
    if "model" not in config:
        raise SystemExit(f"error: {args.config} has no `model` section.")
    trainer = config.get("trainer") or {}
    per_node, devices = _devices(trainer, args.devices, args.num_nodes)
    strategy = trainer.get("strategy")
    backbone = args.backbone
    if backbone is None and isinstance(strategy, dict):
        backbone = (strategy.get("init_args") or {}).get("backbone")
    backbone = backbone or "auto"

    if args.global_batch_size is not None:
        global_batch, batch_note = args.global_batch_size, "given"
    else:
        per_process = args.batch_size
        if per_process is None:
            data = config.get("data") or {}
            per_process = (data.get("init_args") or data).get("batch_size") if isinstance(data, dict) else None
        if not isinstance(per_process, int) or per_process < 1:
            raise SystemExit("error: no batch size: give --batch-size or set data.init_args.batch_size in the config.")
        replicas = _current_replicas(strategy, devices)
        global_batch = per_process * replicas
        batch_note = f"batch_size {per_process} x {replicas} replica{'s' if replicas > 1 else ''} in the config"

    import torch

    model, on_meta = _instantiate_model(config["model"], args.model_class)
    example = None
    if args.input_shape:
        shape = tuple(int(x) for x in re.split(r"[,x ]+", args.input_shape.strip()) if x)
        dtype = getattr(torch, args.input_dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise SystemExit(f"error: unknown --input-dtype {args.input_dtype!r}.")
        example = torch.zeros((1, *shape), dtype=dtype, device="meta")
    try:
        given = _parse_costs(args.costs)
        split: Union[list[float], list[tuple[float, float, float]]] = [float(x) for x in args.cost_split.split(",")]
        if args.measure:
            if example is None:
                raise ValueError("--measure needs --input-shape (the backbone's input, per sample).")
            from lightning_pipe._model.backbone import find_backbone
            from lightning_pipe.plan._model import measure_module_times

            found = find_backbone(model, backbone)
            inputs = torch.zeros((args.measure_batch, *example.shape[1:]), dtype=example.dtype, device="meta")
            split = measure_module_times([found.module(i) for i in range(len(found))], inputs, args.measure_device)
            given = [sum(t) for t in split]
        costs, param_bytes, acts = backbone_profile(
            model, backbone, given, "auto", example, bytes_per_parameter=args.bytes_per_parameter
        )
        budget = parse_bytes(args.memory_budget) if args.memory_budget else None
        plans = search_plans(
            costs,
            global_batch,
            devices,
            param_bytes=param_bytes,
            activation_bytes=acts,
            memory_budget=budget,
            pipeline_parallel_size=args.pipeline_parallel_size,
            schedules=[s.strip() for s in args.schedules.split(",") if s.strip()],
            optimizer_multiplier=args.optimizer_multiplier,
            microbatch_overhead=args.microbatch_overhead,
            devices_per_node=per_node if args.max_tensor_parallel > 1 else None,
            max_tensor_parallel=args.max_tensor_parallel,
            tensor_divisor=args.tensor_divisor,
            tensor_parallel_overhead=args.tensor_parallel_overhead,
            sequence_parallel=args.sequence_parallel,
            cost_split=split,
            transfer_time=args.transfer_time,
            data_parallel_time_per_byte=args.data_parallel_time_per_byte,
        )
    except (ValueError, AttributeError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    shown: list[Plan] = []
    seen: set[tuple[int, int, str]] = set()
    for plan in plans:  # the best microbatch count of each (pipeline size, tensor-parallel size, schedule)
        key = (plan.pipeline_parallel_size, plan.tensor_parallel_size, plan.schedule)
        if key not in seen:
            seen.add(key)
            shown.append(plan)
    shown = shown[: max(1, args.top)]
    name = type(model).__name__
    cost_note = "measured here, seconds" if args.measure else (
        "parameter counts" if args.costs == "parameters" else "given times"
    )
    memory_note = "parameters, gradients, optimizer state" + (
        " and activations" if acts is not None else " (no activations: give --input-shape to include them)"
    )
    print(
        f"{name}: backbone `{backbone}` with {len(costs)} modules, {sum(param_bytes) / 1e6:.2f} MB of parameters"
        f"{'' if on_meta else ' (built on the CPU)'}; {devices} devices; global batch {global_batch} ({batch_note});"
        f" costs: {cost_note}"
        + (f"; budget {format_bytes(budget)} per device" if budget else "")
    )
    print(f"memory counts {memory_note}.\n")
    print(_table(shown))
    best = plans[0]
    print("\nRecommended:\n" + best.describe())
    print("\nIn Python:\n  " + best.strategy_line())
    print("\nIn the LightningCLI config:\n" + best.yaml_snippet())
    return 0
