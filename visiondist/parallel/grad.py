"""Gradient norm and clipping across the layout.

Under data parallelism the gradients are identical on every replica after the all-reduce, so the local norm is the
global one. Sharded layouts (tensor / pipeline parallel) add their shards' squares here, once per shard.
"""

from __future__ import annotations

from typing import Iterable

import torch


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients, clipped to `max_norm` when it is > 0; returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
