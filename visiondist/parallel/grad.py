"""Gradients across the layout: finishing partial sums, averaging over data parallel, one global
norm for clipping.

After the data-parallel average the gradients are identical on every replica, so only the
model-parallel dims matter for the norm. A TP shard's gradient is a piece of the full gradient: its
squares are summed over the TP group. A replicated parameter's gradient is the same on every TP
rank: it is counted once. Pipeline stages hold disjoint parameters: their squares are summed over
the PP group. FSDP's gradients are DTensor shards: DTensor reduces the norm over their mesh. Calling
`clip_grad_norm_` per rank instead gives each rank a different (wrong) norm and clips the shards and
stages inconsistently.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from visiondist.parallel.mesh import Layout
from visiondist.parallel.tensor import PARTIAL_GRAD, SHARD_DIM


def _all_reduce_flat(
    grads: list[torch.Tensor], all_reduce: Callable[[torch.Tensor], object]
) -> None:
    """Run `all_reduce` (in place) once on the gradients flattened into one buffer and copy the
    result back."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def finish_gradients(params: Iterable[torch.nn.Parameter], layout: Layout) -> None:
    """Sum, over TP, the gradients that are partial over tokens (sequence parallelism), in one flat
    all-reduce.

    Args:
        params: the model's parameters (those marked partial are summed).
        layout: this rank's `Layout`.
    """
    if layout.tp_comm is None:
        return
    grads = [p.grad for p in params if p.grad is not None and getattr(p, PARTIAL_GRAD, False)]
    if grads:
        _all_reduce_flat(grads, layout.tp_comm.all_reduce)


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size
IN_FLIGHT = 2  # buckets reduced at once: one is copied back while the next is on the wire


def buckets(grads: list[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype grouped into buckets of at most `limit` bytes; a gradient
    of `limit` or more is a bucket of its own (reduced in place, no copy)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not out or size + nbytes > limit or out[-1][0].dtype != g.dtype or nbytes >= limit:
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out


def mean_over_group(grads: list[torch.Tensor], group, size: int, limit: int = BUCKET_BYTES) -> int:
    """Average `grads` (in place) over `group` of `size` ranks, bucket by bucket: each bucket
    flattened into a buffer of its own (a gradient of a bucket's size or more reduced where it is)
    and all-reduced asynchronously, at most `IN_FLIGHT` at a time, each copied back while the next
    is reduced. The extra memory is a few buckets, not a copy of every gradient. Returns the most
    bytes of bucket buffers alive at once."""
    pending: list[tuple] = []
    alive = peak = 0

    def finish() -> None:
        nonlocal alive
        work, buffer, bucket = pending.pop(0)
        work.wait()
        buffer.div_(size)
        if buffer is not bucket[0]:
            offset = 0
            for g in bucket:
                g.copy_(buffer[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            alive -= buffer.numel() * buffer.element_size()

    for bucket in buckets(grads, limit):
        if len(bucket) == 1 and bucket[0].is_contiguous():
            buffer = bucket[0]
        else:
            buffer = torch.cat([g.reshape(-1) for g in bucket])
            alive += buffer.numel() * buffer.element_size()
            peak = max(peak, alive)
        pending.append((dist.all_reduce(buffer, group=group, async_op=True), buffer, bucket))
        if len(pending) >= IN_FLIGHT:
            finish()
    while pending:
        finish()
    return peak


def average_over_data_parallel(params: Iterable[torch.nn.Parameter], layout: Layout) -> None:
    """Mean of the gradients over the DP replicas (what DDP does, for models DDP does not wrap:
    pipeline stages, whose backward runs inside torch's schedules), in buckets (`mean_over_group`),
    after the pipeline's flush.

    Args:
        params: the model's parameters (those without a gradient are skipped).
        layout: this rank's `Layout`.
    """
    if layout.dp == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        mean_over_group(grads, layout.dp_group, layout.dp)


def clip_grad_norm(
    params: Iterable[torch.nn.Parameter], max_norm: float, layout: Layout
) -> torch.Tensor:
    """Global L2 norm of the gradients over every shard, clipped to `max_norm` when it is > 0;
    returns the norm before clipping (the same on every rank).

    Args:
        params: the model's parameters (those without a gradient are skipped).
        max_norm: the largest global norm kept; 0: no clipping.
        layout: this rank's `Layout` (the groups the shards are summed over).
    """
    pairs = [(p, grad) for p in params if (grad := p.grad) is not None]
    params = [p for p, _ in pairs]
    # FSDP: DTensor shards, reduced over their DP mesh
    if any(isinstance(grad, DTensor) for _, grad in pairs):
        norm = torch.nn.utils.get_total_norm([grad for _, grad in pairs], foreach=None)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=None)
        # a norm of DTensors is one (torch types it a Tensor); offloaded shards (FSDP's CPU offload)
        # give it on the host: the step's health check reads it beside the loss on the device
        full = norm.full_tensor() if isinstance(norm, DTensor) else norm
        return full.float().to(layout.device)
    sharded = [grad for p, grad in pairs if getattr(p, SHARD_DIM, None) is not None]
    replicated = [grad for p, grad in pairs if getattr(p, SHARD_DIM, None) is None]

    def squared(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=layout.device)
        return torch.nn.utils.get_total_norm(grads, foreach=None).float() ** 2

    sharded_sq = squared(sharded)
    if layout.tp > 1:
        dist.all_reduce(sharded_sq, group=layout.tp_communicator().group)
    total_sq = sharded_sq + squared(replicated)
    if layout.pp > 1:
        dist.all_reduce(total_sq, group=layout.pp_group)
    total = total_sq.sqrt()
    if max_norm > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=None)
    return total
