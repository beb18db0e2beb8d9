"""Data parallelism: DistributedDataParallel over the mesh's "dp" dim."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from visiondist.parallel.mesh import Layout


def wrap_data_parallel(model: nn.Module, layout: Layout) -> nn.Module:
    """DDP over the DP group; a single replica needs no wrapper (and no all-reduce)."""
    if layout.dp == 1:
        return model
    device_ids = [layout.device] if layout.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=layout.dp_group)


def same_buffers(model: nn.Module, layout: Layout) -> None:
    """Every DP replica takes the first one's buffers (BatchNorm's running statistics), as DDP does
    at the start of each training forward. After a step each replica's statistics are its own
    batch's, so an evaluation sharded over the replicas would score each shard with other
    statistics, none of them the checkpoint's (the first replica's): called before an evaluation, so
    that its numbers are the saved model's on any number of ranks.

    Args:
        model: the model as laid out.
        layout: this rank's `Layout` (its DP group).
    """
    if not isinstance(model, DistributedDataParallel) or not model.broadcast_buffers:
        return
    first = dist.get_global_rank(layout.dp_group, 0)
    for buffer in model.module.buffers():
        dist.broadcast(buffer, src=first, group=layout.dp_group)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside whatever wrapper the layout added.

    Args:
        model: the model as laid out.
    """
    return model.module if isinstance(model, DistributedDataParallel) else model
