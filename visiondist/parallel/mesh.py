"""The device mesh and what the rest of the code asks of a layout.

One `DeviceMesh` with named dims ("pp", "dp", "tp"), tensor parallel innermost (neighbouring ranks, fastest links),
pipeline outermost. The engine never branches on the layout; it asks a `Layout` which rank logs, which group a metric
is reduced over, and which DP rank and size the sampler uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from visiondist.parallel.collectives import TPComm

MESH_DIMS = ("pp", "dp", "tp")


@dataclass
class Layout:
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

    @property
    def reads_images(self) -> bool:
        """Only the first pipeline stage (rank 0 of the PP group) reads images."""
        return self.pp_rank == 0

    @property
    def reads_labels(self) -> bool:
        """Only the last pipeline stage reads labels (with looped placement it is on the last PP rank)."""
        return self.pp_rank == self.pp - 1

    def all_reduce_dp(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce in place over data-parallel replicas (the ranks that saw different samples)."""
        if self.dp > 1:
            dist.all_reduce(tensor, op=op, group=self.dp_group)
        return tensor

    def describe(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp} ({self.world_size} ranks on {self.device.type})"


def build_layout(dp: int, tp: int, pp: int, device: torch.device, local_rank: int) -> Layout:
    """Create the mesh over the initialised default process group (its world size must be dp*tp*pp)."""
    world = dist.get_world_size()
    if world != dp * tp * pp:
        raise ValueError(f"world size {world} != dp x tp x pp = {dp} x {tp} x {pp}")
    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
    pp_rank, dp_rank, tp_rank = mesh.get_coordinate()
    tp_comm = TPComm(mesh.get_group("tp")) if tp > 1 else None
    return Layout(mesh, device, dist.get_rank(), world, local_rank, dp, tp, pp, dp_rank, tp_rank, pp_rank, tp_comm)
