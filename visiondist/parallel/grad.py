"""Gradients across the layout: finishing partial sums, averaging over data parallel, one global norm for clipping.

After the data-parallel average the gradients are identical on every replica, so only the model-parallel dims
matter for the norm. A TP shard's gradient is a piece of the full gradient: its squares are summed over the TP group.
A replicated parameter's gradient is the same on every TP rank: it is counted once. Pipeline stages hold disjoint
parameters: their squares are summed over the PP group. FSDP's gradients are DTensor shards: DTensor reduces the
norm over their mesh. Calling `clip_grad_norm_` per rank instead gives each rank
a different (wrong) norm and clips the shards and stages inconsistently.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from visiondist.parallel.mesh import Layout
from visiondist.parallel.tensor import PARTIAL_GRAD, SHARD_DIM


def _all_reduce_flat(grads: list[torch.Tensor], all_reduce: Callable[[torch.Tensor], object]) -> None:
    """Run `all_reduce` (in place) once on the gradients flattened into one buffer and copy the result back."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def finish_gradients(params: Iterable[torch.nn.Parameter], layout: Layout) -> None:
    """Sum, over TP, the gradients that are partial over tokens (sequence parallelism), in one flat all-reduce."""
    if layout.tp_comm is None:
        return
    grads = [p.grad for p in params if p.grad is not None and getattr(p, PARTIAL_GRAD, False)]
    if grads:
        _all_reduce_flat(grads, layout.tp_comm.all_reduce)


def average_over_data_parallel(params: Iterable[torch.nn.Parameter], layout: Layout) -> None:
    """Mean of the gradients over the DP replicas, in one flat all-reduce (what DDP does, for models DDP does not
    wrap: pipeline stages, whose backward runs inside torch's schedules)."""
    if layout.dp == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]

    def mean(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=layout.dp_group)
        flat.div_(layout.dp)

    if grads:
        _all_reduce_flat(grads, mean)


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, layout: Layout) -> torch.Tensor:
    """Global L2 norm of the gradients over every shard, clipped to `max_norm` when it is > 0; returns the norm
    before clipping (the same on every rank)."""
    params = [p for p in params if p.grad is not None]
    if any(isinstance(p.grad, DTensor) for p in params):  # FSDP: DTensor shards, reduced over their DP mesh
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm.full_tensor().float()
    sharded = [p.grad for p in params if getattr(p, SHARD_DIM, None) is not None]
    replicated = [p.grad for p in params if getattr(p, SHARD_DIM, None) is None]

    def squared(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=layout.device)
        return torch.nn.utils.get_total_norm(grads, foreach=True).float() ** 2

    sharded_sq = squared(sharded)
    if layout.tp > 1:
        dist.all_reduce(sharded_sq, group=layout.tp_comm.group)
    total_sq = sharded_sq + squared(replicated)
    if layout.pp > 1:
        dist.all_reduce(total_sq, group=layout.pp_group)
    total = total_sq.sqrt()
    if max_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total
