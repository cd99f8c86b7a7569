"""The job's processes: the mesh that groups them, the ranks that rank 0 launched, and ending those when it fails."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Optional

from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_pipe._compat.torch import mesh_group_options
from lightning_pipe.partition import resolve_sizes

#: How long a failing rank 0 gives the ranks it launched to fail on their own (and say why) before it ends them.
GRACE_S = 3.0


#: The mesh's dimensions, outermost first. ``"data_parallel"`` is named as in Lightning's ``ModelParallelStrategy``,
#: so a ``configure_model`` written for it finds ``self.device_mesh["data_parallel"]``; ``"pipeline_parallel"`` is the
#: pipeline's own. (Before 0.2 they were ``("dp", "pp")``.)
MESH_DIMS = ("data_parallel", "pipeline_parallel")


#: The dimensions of the mesh for ``data_parallel="hsdp"``: the replicas form a 2-D grid, each row one group of
#: replicas that shard the stage (``"data_parallel_shard"``, consecutive ranks: one node), the rows replicating it
#: (``"data_parallel_replicate"``); ``"data_parallel"`` is both, flattened.
HSDP_DIMS = ("data_parallel_replicate", "data_parallel_shard", "pipeline_parallel")
#: The innermost dimension with ``tensor_parallel_size > 1``, named as in Lightning's ``ModelParallelStrategy``: the
#: processes that split each block are consecutive ranks (one node), then come the pipeline and the replicas.
TP_DIM = "tensor_parallel"


def pipeline_mesh(
    pipeline_parallel_size: Any,
    data_parallel_size: Any,
    world_size: int,
    device_type: str,
    backend: Optional[str],
    timeout: Optional[timedelta],
    data_parallel: str = "ddp",
    shard_size: Any = "auto",
    processes_per_node: int = 1,
    tensor_parallel_size: int = 1,
) -> DeviceMesh:
    """The mesh over every process, dimensions :data:`MESH_DIMS`, its ``"auto"`` sizes resolved against
    ``world_size``: each row (``mesh["pipeline_parallel"]``) is one pipeline, each column (``mesh["data_parallel"]``)
    the replicas of one pipeline rank. With ``data_parallel="hsdp"`` the replicas are split further
    (:data:`HSDP_DIMS`), and ``"data_parallel"`` is their flattened dimension. Every sub-group gets ``timeout``."""
    tp = tensor_parallel_size
    if world_size % tp:
        raise ValueError(
            f"`PipelineStrategy(tensor_parallel_size={tp})` does not divide the {world_size} processes the Trainer"
            " runs (devices * num_nodes). Make pipeline_parallel_size * data_parallel_size * tensor_parallel_size"
            " equal the number of processes."
        )
    pp, dp = resolve_sizes(pipeline_parallel_size, data_parallel_size, world_size // tp)
    tail = ((TP_DIM,), (tp,)) if tp > 1 else ((), ())
    if data_parallel != "hsdp":
        names, sizes = MESH_DIMS + tail[0], (dp, pp) + tail[1]
        return init_device_mesh(
            device_type, sizes, mesh_dim_names=names,
            backend_override=mesh_group_options(dict(zip(names, sizes)), world_size, backend, timeout),
        )
    shard = hsdp_shard_size(shard_size, dp, processes_per_node)
    names, sizes = HSDP_DIMS + tail[0], (dp // shard, shard, pp) + tail[1]
    mesh = init_device_mesh(
        device_type, sizes, mesh_dim_names=names,
        backend_override=mesh_group_options(dict(zip(names, sizes)), world_size, backend, timeout),
    )
    flat = mesh_group_options({"data_parallel": dp}, world_size, backend, timeout).get("data_parallel")
    mesh[HSDP_DIMS[:2]]._flatten("data_parallel", backend_override=flat)
    return mesh


def pipelines(mesh: DeviceMesh) -> Any:
    """The global ranks as a ``[pipeline][pipeline rank]`` table: one row per replica (and tensor rank)."""
    names = list(mesh.mesh_dim_names or ())
    axis = names.index("pipeline_parallel")
    table = mesh.mesh.movedim(axis, -1)
    return table.reshape(-1, table.shape[-1])


def hsdp_shard_size(shard_size: Any, dp: int, processes_per_node: int) -> int:
    """The replicas per sharding group: as given, or (``"auto"``) the processes of one node, which must divide the
    replicas."""
    shard = min(processes_per_node, dp) if shard_size == "auto" else shard_size
    if dp % shard:
        fits = max(d for d in range(1, dp + 1) if dp % d == 0 and d <= shard)
        given = "'auto' (the processes per node)" if shard_size == "auto" else str(shard_size)
        raise ValueError(
            f"`PipelineStrategy(data_parallel='hsdp', data_parallel_shard_size={given})` shards each stage over groups"
            f" of {shard} replicas, which does not divide the {dp} replicas (data_parallel_size). Pick a"
            f" `data_parallel_shard_size` that divides {dp}, e.g. {fits}."
        )
    return shard


def launched_processes(launcher: Any) -> list[Any]:
    """The processes (``subprocess.Popen``) Lightning's launcher started from this one: the other ranks on rank 0 of a
    job started as one script, else none."""
    if isinstance(launcher, _SubprocessScriptLauncher):
        return list(launcher.procs)
    return []


def end_launched_processes(launcher: Any, exception: BaseException, rank: int) -> None:
    """After ``exception`` on the rank that launched the others: they may wait on it in a transfer. Give them a moment
    to fail on their own (and print why), then end them so that no process is left hanging."""
    procs = launched_processes(launcher)
    if not procs:
        return
    # Say why now: when a launched rank has failed too, Lightning's observer thread SIGKILLs this process as well,
    # possibly before Python prints the traceback.
    text = "".join(traceback.format_exception_only(type(exception), exception)).rstrip()
    sys.stderr.write(f"[rank {rank}] {text}\n")
    sys.stderr.flush()
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    launcher.kill(signal.SIGKILL)
