"""Data parallelism: DistributedDataParallel over the mesh's "dp" dim."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from visiondist.parallel.mesh import Layout


def wrap_data_parallel(model: nn.Module, layout: Layout) -> nn.Module:
    """DDP over the DP group; a single replica needs no wrapper (and no all-reduce)."""
    if layout.dp == 1:
        return model
    device_ids = [layout.device] if layout.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=layout.dp_group)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside whatever wrapper the layout added."""
    return model.module if isinstance(model, DistributedDataParallel) else model
