"""The arguments of ``PipelineStrategy`` that shape the pipeline, checked when the strategy is built.

Each check raises ``ValueError`` naming the argument as the user spelled it and the fix; ``"auto"`` is resolved here
where it does not depend on the processes (``stages_per_rank``), and later where it does (the sizes, at setup).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

from lightning_pipe._bytes import parse_bytes
from lightning_pipe._parallel_dims import ParallelDims
from lightning_pipe.partition import BALANCE_MODES, Size
from lightning_pipe.schedules import Config, schedule_spec
from lightning_pipe.timeline import TimelineOptions

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

DataParallel = Literal["ddp", "fsdp", "hsdp"]
DATA_PARALLEL_MODES = ("ddp", "fsdp", "hsdp")


@dataclass(frozen=True)
class PipelineOptions:
    """The validated ``PipelineStrategy`` arguments that shape the pipeline, under the names the user passes them.

    ``schedule`` is the schedule's name as torch knows it, or ``"auto"`` ([Note: configuration by measurement]);
    ``stages_per_rank`` is resolved for a named schedule (for ``"auto"``, the user's value or ``"auto"``);
    ``timeline`` is resolved (``None``: no trace), and ``stall_timeout`` is in seconds (a ``timedelta`` converted).
    What the pipeline runs is :attr:`config`, or what the chooser settles at setup.
    """

    pipeline_parallel_size: Size
    data_parallel_size: Size
    num_microbatches: Size
    schedule: str
    stages_per_rank: Size
    backbone: Union[str, list[str]]
    balance: Union[str, list[int]]
    activation_checkpointing: Union[bool, list[str], Callable[[nn.Module], bool]]
    timeline: Optional[TimelineOptions]
    stall_timeout: Optional[float]  # seconds
    check_data_every_n_batches: Optional[int]
    data_parallel: Optional[str] = None  # None: "ddp", or "fsdp" when `configure_model` calls `fully_shard`
    data_parallel_shard_size: Size = "auto"
    reshard_after_forward: bool = False
    tensor_parallel_size: int = 1
    #: ``_model.tensor_parallel.TensorParallelPlan``, spelled out (that module is in a higher layer than this one)
    tensor_parallel_plan: Union[None, str, dict, Callable[[nn.Module, DeviceMesh], None]] = None
    max_memory: Optional[int] = None  # bytes a process may hold, for ``schedule="auto"``
    compile: Optional[dict] = None  # ``torch.compile``'s options for each block; ``None``: not compiled
    keep_split: bool = False  # leave the module split after each Trainer call

    @property
    def auto(self) -> bool:
        """``schedule="auto"``: setup chooses the :class:`~lightning_pipe.schedules.Config`."""
        return self.schedule == "auto"

    def parallel_dims(self, world_size: int, processes_per_node: int) -> ParallelDims:
        """The degrees these options ask for on ``world_size`` processes, ``"auto"`` resolved
        (:meth:`ParallelDims.resolve`)."""
        hybrid = self.data_parallel_shard_size if self.data_parallel == "hsdp" else None
        return ParallelDims.resolve(
            self.pipeline_parallel_size, self.data_parallel_size, self.tensor_parallel_size, world_size,
            hybrid_shard=hybrid, processes_per_node=processes_per_node,
        )

    @property
    def config(self) -> Optional[Config]:
        """What the explicit arguments ask the pipeline to run; ``None`` for ``schedule="auto"``."""
        if self.auto:
            return None
        assert isinstance(self.stages_per_rank, int)
        return Config(self.schedule, self.stages_per_rank, self.num_microbatches)


def validated_options(
    *,
    pipeline_parallel_size: Size = "auto",
    data_parallel_size: Size = "auto",
    num_microbatches: Size = "auto",
    schedule: str = "1F1B",
    stages_per_rank: Size = "auto",
    backbone: Union[str, list[str]] = "auto",
    balance: Union[str, list[int]] = "uniform",
    activation_checkpointing: Union[bool, list[str], Callable[[nn.Module], bool]] = False,
    timeline: Union[None, bool, int, str, dict, TimelineOptions] = None,
    stall_timeout: Union[None, float, timedelta] = None,
    check_data_every_n_batches: Optional[int] = None,
    data_parallel: Optional[DataParallel] = None,
    data_parallel_shard_size: Size = "auto",
    reshard_after_forward: bool = False,
    tensor_parallel_size: int = 1,
    tensor_parallel_plan: Union[None, str, dict, Callable[[nn.Module, DeviceMesh], None]] = None,
    max_memory: Union[None, int, str] = None,
    compile: Union[bool, dict] = False,
    keep_split: bool = False,
) -> PipelineOptions:
    """Check the constructor's arguments, by keyword as ``PipelineStrategy`` takes them (raising ``ValueError`` that
    names the fix), and resolve ``"auto"`` where it does not depend on the processes."""
    for name, value in (
        ("pipeline_parallel_size", pipeline_parallel_size),
        ("data_parallel_size", data_parallel_size),
        ("num_microbatches", num_microbatches),
        ("stages_per_rank", stages_per_rank),
        ("data_parallel_shard_size", data_parallel_shard_size),
    ):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"`PipelineStrategy({name}={value!r})` must be a positive integer or 'auto'.")
    if isinstance(balance, str) and balance not in BALANCE_MODES:
        raise ValueError(
            f"`PipelineStrategy(balance={balance!r})` is unknown. Use one of {list(BALANCE_MODES)} or a list"
            " with the number of backbone modules in each stage."
        )
    auto = str(schedule).lower() == "auto"
    spec = schedule_spec("Interleaved1F1B" if auto else schedule)  # auto: checked as the looped schedules are
    if max_memory is not None and not auto:
        raise ValueError(
            "`PipelineStrategy(max_memory=...)` bounds the configurations `schedule='auto'` considers; set"
            " `schedule='auto'`, or drop the argument."
        )
    if max_memory is not None:
        max_memory = parse_bytes(max_memory)
    if stages_per_rank == "auto" and not auto:
        stages_per_rank = spec.default_stages_per_rank()
    if not spec.multi_stage and stages_per_rank != 1:  # (auto: the chooser weighs one-stage schedules at 1)
        raise ValueError(
            f"`PipelineStrategy(schedule={spec.name!r})` runs one stage per process, but"
            f" `stages_per_rank={stages_per_rank}`. Use a multi-stage schedule such as 'Interleaved1F1B', or set"
            " `stages_per_rank=1`."
        )
    if spec.placement == "v" and stages_per_rank != 2:
        raise ValueError(
            f"`PipelineStrategy(schedule={spec.name!r})` places exactly 2 stages per process;"
            f" set `stages_per_rank=2` (got {stages_per_rank})."
        )
    seconds = stall_timeout.total_seconds() if isinstance(stall_timeout, timedelta) else stall_timeout
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0):
        raise ValueError(
            f"`PipelineStrategy(stall_timeout={stall_timeout!r})` must be a positive number of seconds, a `timedelta`,"
            " or None (no report)."
        )
    every = check_data_every_n_batches
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(
            f"`PipelineStrategy(check_data_every_n_batches={every!r})` must be a positive integer, or None to turn the"
            " check off."
        )
    if data_parallel is not None and data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(
            f"`PipelineStrategy(data_parallel={data_parallel!r})` is unknown. Use 'ddp' (each stage replicated over its"
            " replicas), 'fsdp' (each stage sharded over them) or 'hsdp' (sharded within groups of"
            " `data_parallel_shard_size` replicas, replicated across the groups)."
        )
    if data_parallel != "hsdp" and data_parallel_shard_size != "auto":
        raise ValueError(
            f"`PipelineStrategy(data_parallel_shard_size={data_parallel_shard_size})` applies to"
            f" `data_parallel='hsdp'` only (got {data_parallel!r}). Set `data_parallel='hsdp'`, or drop the argument."
        )
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"`PipelineStrategy(reshard_after_forward={reshard_after_forward!r})` must be True or False.")
    if reshard_after_forward and data_parallel in (None, "ddp"):
        raise ValueError(
            "`PipelineStrategy(reshard_after_forward=True)` applies to sharded stages only. Set"
            " `data_parallel='fsdp'` or 'hsdp', or drop the argument."
        )
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"`PipelineStrategy(tensor_parallel_size={tp!r})` must be a positive integer (1: none).")
    if tp == 1 and tensor_parallel_plan is not None:
        raise ValueError(
            "`PipelineStrategy(tensor_parallel_plan=...)` needs `tensor_parallel_size` > 1 (the processes that split"
            " each block); set it, or drop the plan."
        )
    if not isinstance(keep_split, bool):
        raise TypeError(f"`PipelineStrategy(keep_split={keep_split!r})` must be `True` or `False`.")
    if not isinstance(compile, (bool, dict)):
        raise ValueError(
            f"`PipelineStrategy(compile={compile!r})` must be `True`, `False`, or a dict of `torch.compile`'s options"
            " (e.g. `{'mode': 'max-autotune'}`)."
        )
    return PipelineOptions(
        pipeline_parallel_size=pipeline_parallel_size, data_parallel_size=data_parallel_size,
        num_microbatches=num_microbatches, schedule="auto" if auto else spec.name, stages_per_rank=stages_per_rank,
        backbone=backbone,
        balance=balance, activation_checkpointing=activation_checkpointing, timeline=TimelineOptions.resolve(timeline),
        stall_timeout=seconds, check_data_every_n_batches=every, data_parallel=data_parallel,
        data_parallel_shard_size=data_parallel_shard_size, reshard_after_forward=reshard_after_forward,
        tensor_parallel_size=tp, tensor_parallel_plan=tensor_parallel_plan, max_memory=max_memory,
        compile=({} if compile is True else dict(compile)) if compile is not False else None, keep_split=keep_split,
    )


def option_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """Of ``PipelineStrategy.__init__``'s arguments (its ``locals()``), those :func:`validated_options` checks."""
    return {name: arguments[name] for name in inspect.signature(validated_options).parameters}
