"""Tensor-parallel collectives as autograd functions, named by what they do forward (Megatron's f / g and their
sequence-parallel counterparts), with a counter of the traffic they cause.

Why not DTensor: on the CPU/gloo set-up these small functions ran a tiny ViT's step faster than `parallelize_module`
(benchmarks/RESULTS.md), keep every parameter a plain `torch.Tensor` (foreach AdamW and the global-norm clip work
unchanged), and let attention be split by whole heads with no fused-qkv reshuffling.

Sequence-parallel tensors are (batch, tokens, width) with the tokens split into `tp` equal chunks. ViT token counts
(cls + patches: 197, 257, ...) rarely divide by `tp`, so the sequence is zero-padded at the end to a multiple of `tp`
while sharded and cut back to its true length whenever it is gathered. Padded rows only ever pass through token-wise
ops (LayerNorm, residual adds, the MLP) and are dropped before attention and at the end, so they never reach a real
token and receive exactly zero gradient.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from visiondist.compat import all_gather_into, reduce_scatter_into


class TPComm:
    """The tensor-parallel group of this rank, and the traffic its collectives caused.

    `payload` counts, per collective kind, the bytes of the full tensor each call reduces or gathers (all ranks'
    data: the size Megatron's analysis uses); `calls` counts the calls. `ring_bytes()` converts that into what each
    rank sends with ring algorithms: 2(n-1)/n of the payload for an all-reduce, (n-1)/n for all-gather and
    reduce-scatter — so sequence parallelism (reduce-scatter + all-gather) moves what one all-reduce moves.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.n_tokens = 0  # true sequence length of the current forward (set on entering the SP region)
        self.payload: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def record(self, kind: str, full: torch.Tensor) -> None:
        self.payload[kind] += full.numel() * full.element_size()
        self.calls[kind] += 1

    def reset(self) -> None:
        self.payload.clear()
        self.calls.clear()

    def ring_bytes(self) -> float:
        n = self.size
        factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
        return sum(factor[kind] * size for kind, size in self.payload.items())

    # -- raw collectives over the TP group ------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        self.record("all_reduce", x)
        return x

    def padded(self, n_tokens: int) -> int:
        return -(-n_tokens // self.size) * self.size

    def all_gather_tokens(self, local: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """(B, n_local, C) chunks of every rank -> (B, n_tokens, C), padding cut off."""
        b, n_local, c = local.shape
        out = local.new_empty(self.size * b, n_local, c)
        all_gather_into(out, local.contiguous(), self.group)
        self.record("all_gather", out)
        full = out.view(self.size, b, n_local, c).transpose(0, 1).reshape(b, self.size * n_local, c)
        return full[:, :n_tokens]

    def reduce_scatter_tokens(self, full: torch.Tensor) -> torch.Tensor:
        """(B, n_tokens, C) partial sums on every rank -> this rank's (B, n_local, C) chunk of their sum."""
        full = self._pad(full)
        b, n, c = full.shape
        chunks = full.view(b, self.size, n // self.size, c).transpose(0, 1).contiguous()
        out = full.new_empty(b, n // self.size, c)
        reduce_scatter_into(out, chunks.view(self.size * b, n // self.size, c), self.group)
        self.record("reduce_scatter", full)
        return out

    def local_tokens(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a (B, n_tokens, C) tensor every rank holds (no communication)."""
        full = self._pad(full)
        n_local = full.shape[1] // self.size
        return full[:, self.rank * n_local : (self.rank + 1) * n_local].contiguous()

    def _pad(self, full: torch.Tensor) -> torch.Tensor:
        extra = self.padded(full.shape[1]) - full.shape[1]
        return F.pad(full, (0, 0, 0, extra)) if extra else full


# ----------------------------------------------------------------------------------------------------------------
# Without sequence parallelism: the sub-block input is replicated, its output partial.


class _CopyToTP(Function):
    """Forward: identity (the input is replicated). Backward: all-reduce (each rank's heads add their gradient)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_reduce(grad.clone()), None


class _ReduceFromTP(Function):
    """Forward: all-reduce the partial outputs of the row-parallel layer. Backward: identity."""

    @staticmethod
    def forward(ctx, x, comm):
        return comm.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ----------------------------------------------------------------------------------------------------------------
# With sequence parallelism: tokens sharded outside attention / MLP, gathered inside.


class _GatherTokens(Function):
    """Forward: all-gather the token chunks. Backward: reduce-scatter the gradient when each rank's consumer
    contributed a part of it (column-parallel layers), or just keep this rank's chunk when the consumer is a
    replicated computation whose gradient is already whole on every rank (leaving the SP region)."""

    @staticmethod
    def forward(ctx, local, comm, n_tokens, grad_is_partial):
        ctx.comm, ctx.grad_is_partial = comm, grad_is_partial
        return comm.all_gather_tokens(local, n_tokens)

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        return (comm.reduce_scatter_tokens(grad) if ctx.grad_is_partial else comm.local_tokens(grad)), None, None, None


class _ScatterTokens(Function):
    """Forward: this rank's token chunk of the sum of every rank's partial tensor (reduce-scatter, after row-parallel
    layers), or of a tensor every rank holds whole (entering the SP region: no communication). Backward: all-gather."""

    @staticmethod
    def forward(ctx, full, comm, partial):
        ctx.comm, ctx.n_tokens = comm, full.shape[1]
        return comm.reduce_scatter_tokens(full) if partial else comm.local_tokens(full)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_gather_tokens(grad, ctx.n_tokens), None, None


def copy_to_tp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return _ReduceFromTP.apply(x, comm)


def all_gather_tokens(x: torch.Tensor, comm: TPComm, n_tokens: int) -> torch.Tensor:
    """Before column-parallel layers: gather the token chunks; backward reduce-scatters."""
    return _GatherTokens.apply(x, comm, n_tokens, True)


def reduce_scatter_tokens(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """After row-parallel layers: sum the partial outputs, keep this rank's chunk; backward all-gathers."""
    return _ScatterTokens.apply(x, comm, True)


def split_tokens(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Enter the SP region from a replicated tensor: keep this rank's chunk; backward all-gathers."""
    return _ScatterTokens.apply(x, comm, False)


def gather_tokens(x: torch.Tensor, comm: TPComm, n_tokens: int) -> torch.Tensor:
    """Leave the SP region into a replicated computation: gather; backward keeps this rank's chunk."""
    return _GatherTokens.apply(x, comm, n_tokens, False)
