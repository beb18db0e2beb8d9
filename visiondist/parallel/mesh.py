"""The device mesh and what the rest of the code asks of a layout.

One `DeviceMesh` with named dims ("pp", "dp", "tp"), tensor parallel innermost (neighbouring ranks,
fastest links), pipeline outermost. The engine never branches on the layout; it asks a `Layout`
which rank logs, which group a metric is reduced over, and which DP rank and size the sampler uses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from visiondist.config.layout import RunLayout
from visiondist.parallel.collectives import TPComm

MESH_DIMS = ("pp", "dp", "tp")


@dataclass
class Layout:
    """A rank's place in the device mesh pp x dp x tp, and what the engine asks of it (the rank that
    logs, the group a metric is reduced over, the DP rank a sampler reads for).

    Attributes:
        mesh: the device mesh, dims ("pp", "dp", "tp").
        device: this rank's device.
        rank: the global rank.
        world_size: ranks in all.
        local_rank: the rank's index on its node.
        dp: data-parallel degree.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
        dp_rank: this rank's coordinate along dp.
        tp_rank: this rank's coordinate along tp.
        pp_rank: this rank's coordinate along pp.
        tp_comm: the TP group and its traffic counter; None when tp == 1.
        nodes: the node index of every global rank.
        run: the job's resolved `RunLayout`, which the trainer reads every switch from.
    """

    mesh: DeviceMesh
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    dp: int
    tp: int
    pp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    tp_comm: Optional[TPComm] = None  # the TP group and its traffic counter; None when tp == 1
    # node index of every global rank (torchrun's GROUP_RANK, SLURM_NODEID)
    nodes: tuple[int, ...] = ()
    # the job's resolved layout (every switch concrete); the trainer needs it
    run: Optional[RunLayout] = None

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes files and draws progress."""
        return self.rank == 0

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    def groups(self) -> list[dist.ProcessGroup]:
        """One process group per mesh dimension (pp, dp, tp): the groups a collective timeout
        applies to."""
        return [self.mesh.get_group(dim) for dim in self.mesh.mesh_dim_names or ()]

    def tp_communicator(self) -> TPComm:
        """`tp_comm`, which a layout with tp > 1 has (the TP group and its traffic counter)."""
        if self.tp_comm is None:
            raise ValueError(f"a layout with tp={self.tp} has no tensor-parallel group")
        return self.tp_comm

    @property
    def reads_images(self) -> bool:
        """Only the first pipeline stage (rank 0 of the PP group) reads images."""
        return self.pp_rank == 0

    @property
    def reads_labels(self) -> bool:
        """Only the last pipeline stage reads labels (with looped placement it is on the last PP
        rank)."""
        return self.pp_rank == self.pp - 1

    def all_reduce_dp(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce in place over data-parallel replicas (the ranks that saw different samples)."""
        if self.dp > 1:
            dist.all_reduce(tensor, op=op, group=self.dp_group)
        return tensor

    def placement(self) -> list[str]:
        """Where each mesh dimension's groups sit: e.g. `tp groups [0, 1] [2, 3]: each inside one
        node`; under HSDP the DP dimension as FSDP's shard groups and the replicas across them."""
        grid = np.asarray(self.mesh.mesh.tolist())
        dims: tuple[str, ...] = MESH_DIMS
        # FSDP splits dp as (replicate, shard): shards are neighbours
        if self.run is not None and self.run.hsdp:
            shard = self.run.shard_size
            grid = grid.reshape(self.pp, self.dp // shard, shard, self.tp)
            dims = ("pp", "dp replicate", "dp shard", "tp")
        return placement(grid.tolist(), self.nodes or (0,) * self.world_size, dims=dims)


def placement(
    grid: list, nodes: tuple[int, ...], shown: int = 4, dims: tuple[str, ...] = MESH_DIMS
) -> list[str]:
    """For each mesh dimension of size > 1: its groups of global ranks (the first `shown`) and how
    many nodes one group spans. `grid`: the nested list of global ranks over `dims` ((pp, dp, tp));
    `nodes`: node index of each global rank."""
    ranks = np.asarray(grid)
    lines = []
    for axis, dim in enumerate(dims):
        size = ranks.shape[axis]
        if size == 1:
            continue
        groups = np.moveaxis(ranks, axis, -1).reshape(-1, size).tolist()
        spans = max(len({nodes[r] for r in group}) for group in groups)
        listed = " ".join(str(g) for g in groups[:shown]) + (
            f" ... ({len(groups)} groups)" if len(groups) > shown else ""
        )
        lines.append(
            f"{dim} groups {listed}: "
            + ("each inside one node" if spans == 1 else f"across {spans} nodes")
        )
    return lines


def build_layout(
    dp: int,
    tp: int,
    pp: int,
    device: torch.device,
    local_rank: int,
    run: Optional[RunLayout] = None,
) -> Layout:
    """Create the mesh over the initialised default process group (its world size must be dp*tp*pp);
    `run`: the job's `RunLayout`, which the engine reads every parallel switch from.

    Args:
        dp: data-parallel degree.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
        device: this rank's device.
        local_rank: this rank's index on its node.
        run: the job's `RunLayout`; None: a bare layout (a test's, a notebook's).

    Returns:
        This rank's `Layout`.

    Raises:
        ValueError: the world size is not dp x tp x pp.
    """
    world = dist.get_world_size()
    if world != dp * tp * pp:
        raise ValueError(f"world size {world} != dp x tp x pp = {dp} x {tp} x {pp}")
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # the mesh spans the world
        raise RuntimeError(f"rank {dist.get_rank()} is not in the device mesh {mesh}")
    pp_rank, dp_rank, tp_rank = coordinate
    tp_comm = TPComm(mesh.get_group("tp")) if tp > 1 else None
    # the dry run: nothing to gather; the job's ranks fill whole nodes in order
    if dist.get_backend() == "fake":
        nodes = [r // run.per_node for r in range(world)] if run is not None else [0] * world
    else:
        nodes = [0] * world  # every rank's, filled in by the gather
        dist.all_gather_object(nodes, node_index(os.environ))
    return Layout(
        mesh,
        device,
        dist.get_rank(),
        world,
        local_rank,
        dp,
        tp,
        pp,
        dp_rank,
        tp_rank,
        pp_rank,
        tp_comm,
        tuple(nodes),
        run,
    )


def node_index(env) -> int:
    """This process's node: torchrun's GROUP_RANK, srun's SLURM_NODEID, else 0 (one machine)."""
    return int(env.get("GROUP_RANK", env.get("SLURM_NODEID", 0)))
