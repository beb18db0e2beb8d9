"""Tensor-parallel collectives as autograd functions, named by what they do forward (Megatron's f /
g and their sequence-parallel counterparts), with a counter of the traffic they cause.

Each collective is a custom op (`visiondist::tp_all_reduce`, `tp_all_gather`, `tp_reduce_scatter`):
opaque to `torch.compile`, with a fake implementation for tracing, so a compiled block traces its
collectives into one graph instead of breaking at each (a Python counter mutated inside an autograd
function breaks the graph, and a backward traced ahead of time would never run such Python again).
The op's body runs at every call, compiled or not, forward and backward: the collective and its
count happen there, outside the traced region.

Why not DTensor: on the CPU/gloo set-up these small functions ran a tiny ViT's step faster than
`parallelize_module` (benchmarks/RESULTS.md), keep every parameter a plain `torch.Tensor` (foreach
AdamW and the global-norm clip work unchanged), and let attention be split by whole heads with no
fused-qkv reshuffling.

Sequence-parallel tensors are (batch, tokens, width) with the tokens split into `tp` equal chunks.
ViT token counts (cls + patches: 197, 257, ...) rarely divide by `tp`, so the sequence is
zero-padded at the end to a multiple of `tp` while sharded and cut back to its true length whenever
it is gathered. Padded rows only ever pass through token-wise ops (LayerNorm, residual adds, the
MLP) and are dropped before attention and at the end, so they never reach a real token and receive
exactly zero gradient.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from visiondist.compat import all_gather_into, reduce_scatter_into

# the custom ops name their group by a string: this process's TP groups by key
_COMMS: dict[str, TPComm] = {}


class TPComm:
    """The tensor-parallel group of this rank, and the traffic its collectives caused.

    `payload` counts, per collective kind, the bytes of the full tensor each call reduces or gathers
    (all ranks' data: the size Megatron's analysis uses); `calls` counts the calls. `ring_bytes()`
    converts that into what each rank sends with ring algorithms: 2(n-1)/n of the payload for an
    all-reduce, (n-1)/n for all-gather and reduce-scatter — so sequence parallelism (reduce-scatter
    + all-gather) moves what one all-reduce moves.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.key = f"tp{len(_COMMS)}"
        _COMMS[self.key] = self
        # true sequence length of the current forward (set on entering the SP region)
        self.n_tokens = 0
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
        factor = {
            "all_reduce": 2 * (n - 1) / n,
            "all_gather": (n - 1) / n,
            "reduce_scatter": (n - 1) / n,
        }
        return sum(factor[kind] * size for kind, size in self.payload.items())

    # -- raw collectives over the TP group ---------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In place (the gradients' flat buffer, outside any compiled region)."""
        x = x.contiguous()
        dist.all_reduce(x, group=self.group)
        self.record("all_reduce", x)
        return x

    def padded(self, n_tokens: int) -> int:
        return -(-n_tokens // self.size) * self.size

    def all_gather_tokens(self, local: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """(B, n_local, C) chunks of every rank -> (B, n_tokens, C), padding cut off."""
        b, n_local, c = local.shape
        out = torch.ops.visiondist.tp_all_gather(local.contiguous(), self.key)
        full = out.view(self.size, b, n_local, c).transpose(0, 1).reshape(b, self.size * n_local, c)
        return full[:, :n_tokens]

    def reduce_scatter_tokens(self, full: torch.Tensor) -> torch.Tensor:
        """(B, n_tokens, C) partial sums on every rank -> this rank's (B, n_local, C) chunk of their
        sum."""
        full = self._pad(full)
        b, n, c = full.shape
        chunks = full.view(b, self.size, n // self.size, c).transpose(0, 1).contiguous()
        return torch.ops.visiondist.tp_reduce_scatter(
            chunks.view(self.size * b, n // self.size, c), self.key
        )

    def local_tokens(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a (B, n_tokens, C) tensor every rank holds (no communication)."""
        full = self._pad(full)
        n_local = full.shape[1] // self.size
        return full[:, self.rank * n_local : (self.rank + 1) * n_local].contiguous()

    def _pad(self, full: torch.Tensor) -> torch.Tensor:
        extra = self.padded(full.shape[1]) - full.shape[1]
        return F.pad(full, (0, 0, 0, extra)) if extra else full


# The collectives as custom ops: a new tensor out (no aliasing), the traffic counted where the
# collective runs.


@torch.library.custom_op("visiondist::tp_all_reduce", mutates_args=())
def _tp_all_reduce(x: torch.Tensor, comm: str) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=_COMMS[comm].group)
    _COMMS[comm].record("all_reduce", out)
    return out


@_tp_all_reduce.register_fake
def _(x, comm):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("visiondist::tp_all_gather", mutates_args=())
def _tp_all_gather(x: torch.Tensor, comm: str) -> torch.Tensor:
    """Every rank's `x` concatenated along dim 0."""
    group = _COMMS[comm]
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x.contiguous(), group.group)
    group.record("all_gather", out)
    return out


@_tp_all_gather.register_fake
def _(x, comm):
    return x.new_empty((_COMMS[comm].size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("visiondist::tp_reduce_scatter", mutates_args=())
def _tp_reduce_scatter(x: torch.Tensor, comm: str) -> torch.Tensor:
    """This rank's dim-0 chunk of the sum over ranks of `x`."""
    group = _COMMS[comm]
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    reduce_scatter_into(out, x.contiguous(), group.group)
    group.record("reduce_scatter", x)
    return out


@_tp_reduce_scatter.register_fake
def _(x, comm):
    return x.new_empty((x.shape[0] // _COMMS[comm].size, *x.shape[1:]))


# --------------------------------------------------------------------------------------------------
# Without sequence parallelism: the sub-block input is replicated, its output partial.


class _CopyToTP(Function):
    """Forward: identity (the input is replicated). Backward: all-reduce (each rank's heads add
    their gradient)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.visiondist.tp_all_reduce(grad, ctx.comm.key), None


class _ReduceFromTP(Function):
    """Forward: all-reduce the partial outputs of the row-parallel layer. Backward: identity."""

    @staticmethod
    def forward(ctx, x, comm):
        return torch.ops.visiondist.tp_all_reduce(x, comm.key)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# --------------------------------------------------------------------------------------------------
# With sequence parallelism: tokens sharded outside attention / MLP, gathered inside.


class _GatherTokens(Function):
    """Forward: all-gather the token chunks. Backward: reduce-scatter the gradient when each rank's
    consumer contributed a part of it (column-parallel layers), or just keep this rank's chunk when
    the consumer is a replicated computation whose gradient is already whole on every rank (leaving
    the SP region)."""

    @staticmethod
    def forward(ctx, local, comm, n_tokens, grad_is_partial):
        ctx.comm, ctx.grad_is_partial = comm, grad_is_partial
        return comm.all_gather_tokens(local, n_tokens)

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        return (
            (comm.reduce_scatter_tokens(grad) if ctx.grad_is_partial else comm.local_tokens(grad)),
            None,
            None,
            None,
        )


class _ScatterTokens(Function):
    """Forward: this rank's token chunk of the sum of every rank's partial tensor (reduce-scatter,
    after row-parallel layers), or of a tensor every rank holds whole (entering the SP region: no
    communication). Backward: all-gather."""

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
    """After row-parallel layers: sum the partial outputs, keep this rank's chunk; backward
    all-gathers."""
    return _ScatterTokens.apply(x, comm, True)


def split_tokens(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    """Enter the SP region from a replicated tensor: keep this rank's chunk; backward
    all-gathers."""
    return _ScatterTokens.apply(x, comm, False)


def gather_tokens(x: torch.Tensor, comm: TPComm, n_tokens: int) -> torch.Tensor:
    """Leave the SP region into a replicated computation: gather; backward keeps this rank's
    chunk."""
    return _GatherTokens.apply(x, comm, n_tokens, False)
