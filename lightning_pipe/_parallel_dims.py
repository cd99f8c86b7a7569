"""The degrees of parallelism, checked once, and the mesh they make: every mesh and group is handed out by name here.

[Note: the mesh]
The mesh's dimensions, outermost first: ``"data_parallel"`` (the pipeline replicas), ``"pipeline_parallel"`` (one
pipeline), and ``"tensor_parallel"`` innermost (the processes that split each block: consecutive ranks, one node;
size 1 without tensor parallelism). ``"data_parallel"`` and ``"tensor_parallel"`` are named as in Lightning's
``ModelParallelStrategy``, which has both whatever their sizes, so a ``configure_model`` written for it finds
``self.device_mesh["data_parallel"]`` and ``self.device_mesh["tensor_parallel"]`` and may test their ``size()``.
With ``data_parallel="hsdp"`` the replicas form a grid, each row one group of replicas that shard the stage
(``"data_parallel_shard"``, consecutive ranks), the rows replicating it (``"data_parallel_replicate"``);
``"data_parallel"`` is both, flattened. A global rank is ``((replica * P) + pipeline rank) * T + tensor rank``.
(Before 0.2 the dimensions were ``("dp", "pp")``.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_pipe._compat.torch import mesh_group_options
from lightning_pipe.partition import Size, resolve_sizes

log = logging.getLogger(__name__)

DATA = "data_parallel"
PIPELINE = "pipeline_parallel"
TENSOR = "tensor_parallel"
DATA_REPLICATE = "data_parallel_replicate"
DATA_SHARD = "data_parallel_shard"


@dataclass
class ParallelDims:
    """The sizes of each dimension ([Note: the mesh]), resolved against the processes and checked by :meth:`resolve`;
    :meth:`build` makes the mesh, after which the groups and sub-meshes are read here.

    Attributes:
        pipeline: processes per pipeline.
        data: pipeline replicas.
        tensor: processes that split each block (1: none).
        shard: with HSDP, the replicas in one sharding group; else ``None``.
        world_size: every process.
    """

    pipeline: int
    data: int
    tensor: int
    shard: Optional[int]
    world_size: int
    mesh: Optional[DeviceMesh] = field(default=None, repr=False)
    loss_weight_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    #: with a pipeline: the group over it that carries each training step's result from the last stage
    result_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)

    @classmethod
    def resolve(
        cls, pipeline: Size, data: Size, tensor: int, world_size: int, hybrid_shard: Optional[Size] = None,
        processes_per_node: int = 1,
    ) -> ParallelDims:
        """The sizes, ``"auto"`` resolved: ``hybrid_shard`` is ``data_parallel_shard_size`` with HSDP (``None``
        without). Raises ``ValueError`` with the arithmetic and the fix."""
        if world_size % tensor:
            raise ValueError(
                f"`PipelineStrategy(tensor_parallel_size={tensor})` does not divide the {world_size} processes the"
                " Trainer runs (devices * num_nodes). Make pipeline_parallel_size * data_parallel_size *"
                " tensor_parallel_size equal the number of processes."
            )
        pp, dp = resolve_sizes(pipeline, data, world_size // tensor)
        shard = None if hybrid_shard is None else hsdp_shard_size(hybrid_shard, dp, processes_per_node)
        return cls(pp, dp, tensor, shard, world_size)

    # ------------------------------------------------------------------------------------------------ the mesh
    def names_and_sizes(self) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """The mesh's dimension names and sizes, outermost first."""
        if self.shard is None:
            return (DATA, PIPELINE, TENSOR), (self.data, self.pipeline, self.tensor)
        rows = self.data // self.shard
        return (DATA_REPLICATE, DATA_SHARD, PIPELINE, TENSOR), (rows, self.shard, self.pipeline, self.tensor)

    def build(self, device_type: str, backend: Optional[str], timeout: Optional[timedelta]) -> DeviceMesh:
        """The mesh over every process, each sub-group with ``timeout``; with a pipeline, also the group that carries
        each training step's result, and with replicas too, the one that carries its loss weight ([Note: overlapped
        reductions])."""
        names, sizes = self.names_and_sizes()
        options = mesh_group_options(dict(zip(names, sizes)), self.world_size, backend, timeout)
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=names, backend_override=options)
        if self.shard is not None:
            flat = mesh_group_options({DATA: self.data}, self.world_size, backend, timeout).get(DATA)
            mesh[(DATA_REPLICATE, DATA_SHARD)]._flatten(DATA, backend_override=flat)
        self.mesh = mesh
        rows = [row.tolist() for row in self.pipelines()]
        if self.pipeline > 1 and self.data > 1:
            self.loss_weight_group, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout)
        if self.pipeline > 1:  # [Note: the step's result, sent before the schedule ends]
            self.result_group, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout)
        log.debug("rank %d: %s, pipeline rank %d", dist.get_rank(), self, self.pipeline_rank)
        return mesh

    def _built(self) -> DeviceMesh:
        if self.mesh is None:
            raise RuntimeError("`ParallelDims.build` makes the mesh when the processes start; read it after that.")
        return self.mesh

    def pipelines(self) -> torch.Tensor:
        """The global ranks as a ``[pipeline][pipeline rank]`` table: one row per replica (and tensor rank)."""
        mesh = self._built()
        table = mesh.mesh.movedim(list(mesh.mesh_dim_names or ()).index(PIPELINE), -1)
        return table.reshape(-1, table.shape[-1])

    @property
    def pipeline_group(self) -> dist.ProcessGroup:
        return self._built().get_group(PIPELINE)

    @property
    def data_group(self) -> dist.ProcessGroup:
        """This rank's replicas (every pipeline's same stage and tensor rank)."""
        return self._built().get_group(DATA)

    @property
    def tensor_group(self) -> Optional[dist.ProcessGroup]:
        return self._built().get_group(TENSOR) if self.tensor > 1 else None

    @property
    def tensor_mesh(self) -> Optional[DeviceMesh]:
        return self._built()[TENSOR] if self.tensor > 1 else None

    @property
    def shard_mesh(self) -> DeviceMesh:
        """What a sharded stage is sharded over: the replicas (FSDP), or their 2-D grid (HSDP)."""
        mesh = self._built()
        return mesh[(DATA_REPLICATE, DATA_SHARD)] if self.shard is not None else mesh[DATA]

    @property
    def pipeline_rank(self) -> int:
        return self._built()[PIPELINE].get_local_rank()

    @property
    def data_rank(self) -> int:
        return self._built()[DATA].get_local_rank()


def is_tensor_parallel(mesh: Optional[DeviceMesh]) -> bool:
    """Whether ``mesh`` (a DTensor's) spans several tensor ranks."""
    names = list(mesh.mesh_dim_names or ()) if mesh is not None else []
    return mesh is not None and TENSOR in names and mesh.size(names.index(TENSOR)) > 1


def sharded_dims(mesh: DeviceMesh) -> list[str]:
    """The dimensions of ``mesh`` (one a ``configure_model`` gave ``fully_shard``) that sharding over it would span:
    those of more than one process, the pipeline's left out (a stage is sharded over its replicas, never over the
    pipeline that holds the other stages). One, or none, is plain sharding over the replicas; two are hybrid."""
    names = list(mesh.mesh_dim_names or (str(d) for d in range(mesh.ndim)))
    return [name for d, name in enumerate(names) if name != PIPELINE and mesh.size(d) > 1]


def hsdp_shard_size(shard_size: Size, dp: int, processes_per_node: int) -> int:
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
