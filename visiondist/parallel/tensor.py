"""Tensor parallelism (Megatron) and sequence parallelism, applied to a finished model by a plan.

A plan is data: module path pattern -> style, registered by the model's own package for its class
(the ViT's, with what each style does to a block: `visiondist.models.vit_parallel`). The styles:
ColwiseParallel (output features split), RowwiseParallel (input features split, partial outputs
all-reduced or reduce-scattered along tokens, the bias added once), ParallelInput (a sub-block's
input enters the TP region), SequenceRegion (SP: tokens split on entry, gathered on exit),
SequenceParallel (SP: replicated weights that see only this rank's tokens).

Parameters keep their names and are tagged: `tp_shard_dim` on shards (0: rows, 1: columns),
`tp_partial_grad` on replicated parameters whose gradient is a partial sum over tokens (SP), to be
all-reduced over TP after backward. Everything outside the plan (patch embedding, position
embedding, cls token, final norm, head) stays replicated and, because every TP rank computes it from
the same input, identical across the group.
"""

from __future__ import annotations

import fnmatch
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from visiondist.parallel.collectives import (
    TPComm,
    all_gather_tokens,
    copy_to_tp,
    gather_tokens,
    reduce_from_tp,
    reduce_scatter_tokens,
    split_tokens,
)

SHARD_DIM = "tp_shard_dim"
PARTIAL_GRAD = "tp_partial_grad"


def _shard(tensor: torch.Tensor, dim: int, comm: TPComm) -> nn.Parameter:
    size = tensor.shape[dim]
    if size % comm.size:
        raise ValueError(f"tp={comm.size} does not divide dimension {dim} of size {size}")
    piece = tensor.detach().chunk(comm.size, dim=dim)[comm.rank].clone()
    param = nn.Parameter(piece, requires_grad=tensor.requires_grad)
    setattr(param, SHARD_DIM, dim)
    return param


def _mark_partial(param: nn.Parameter) -> None:
    setattr(param, PARTIAL_GRAD, True)


class RowParallelLinear(nn.Module):
    """A `Linear` holding this rank's slice of the input features. The partial products are summed
    over TP — by all-reduce, or by reduce-scatter along tokens under SP — and the replicated bias is
    added once, after the sum."""

    def __init__(self, linear: nn.Linear, comm: TPComm, sequence_parallel: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features // comm.size, linear.out_features
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.weight = _shard(linear.weight, 1, comm)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())
            if sequence_parallel:
                _mark_partial(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            out = reduce_scatter_tokens(partial, self.comm)
        else:
            out = reduce_from_tp(partial, self.comm)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (of {self.in_features * self.comm.size}), "
            f"out_features={self.out_features}"
        )


# --------------------------------------------------------------------------------------------------
# Styles: each turns one module into its parallel form (in place, or by returning a replacement).


class ColwiseParallel:
    def apply(self, module: nn.Module, comm: TPComm, sequence_parallel: bool) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"ColwiseParallel expects nn.Linear, got {type(module).__name__}")
        module.weight = _shard(module.weight, 0, comm)
        if module.bias is not None:
            module.bias = _shard(module.bias, 0, comm)
        module.out_features //= comm.size
        return module


class RowwiseParallel:
    def apply(self, module: nn.Module, comm: TPComm, sequence_parallel: bool) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"RowwiseParallel expects nn.Linear, got {type(module).__name__}")
        return RowParallelLinear(module, comm, sequence_parallel)


class ParallelInput:
    """The module's first input enters the TP region (copy, or all-gather of the token chunks under
    SP)."""

    def apply(self, module: nn.Module, comm: TPComm, sequence_parallel: bool) -> nn.Module:
        def enter(_module, args):
            x, *rest = args
            x = (
                all_gather_tokens(x, comm, comm.n_tokens)
                if sequence_parallel
                else copy_to_tp(x, comm)
            )
            return (x, *rest)

        module.register_forward_pre_hook(enter)
        return module


class SequenceRegion:
    """Under SP the module runs on token chunks: split its (replicated) input, gather its output."""

    def apply(self, module: nn.Module, comm: TPComm, sequence_parallel: bool) -> nn.Module:
        if not sequence_parallel:
            return module

        def enter(_module, args):
            x, *rest = args
            comm.n_tokens = x.shape[1]
            return (split_tokens(x, comm), *rest)

        def leave(_module, _args, out):
            return gather_tokens(out, comm, comm.n_tokens)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)
        return module


class SequenceParallel:
    """Replicated parameters of a token-wise module inside the SP region: their gradients are
    partial sums."""

    def apply(self, module: nn.Module, comm: TPComm, sequence_parallel: bool) -> nn.Module:
        if sequence_parallel:
            for param in module.parameters():
                _mark_partial(param)
        return module


Style = ColwiseParallel | RowwiseParallel | ParallelInput | SequenceRegion | SequenceParallel


def _matches(path: str, pattern: str) -> bool:
    """`*` stands for exactly one path component (a block index), as in torchtitan's plans."""
    parts, pats = path.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pats))


def apply_tensor_parallel(model: nn.Module, comm: TPComm, sequence_parallel: bool) -> nn.Module:
    """Shard, in place, every part of `model` that has a registered plan (the model itself, or e.g.
    the ViT backbone inside a detector); everything else stays replicated. A model with no such part
    is an error."""
    targets = [
        (module, plan)
        for _, module in model.named_modules()
        if (plan := _registered_plan(module)) is not None
    ]
    if not targets:
        raise ValueError(
            f"no tensor-parallel plan for {type(model).__name__} or any of its parts: use "
            "parallel.tp=1"
        )
    for module, plan in targets:
        apply_plan(module, plan, comm, sequence_parallel)
    return model


def apply_plan(
    module: nn.Module, plan: dict[str, Style], comm: TPComm, sequence_parallel: bool
) -> nn.Module:
    """Apply `plan` to `module`. Every pattern must match at least one submodule, so a renamed layer
    fails loudly instead of silently staying replicated."""
    modules = dict(module.named_modules())
    for pattern, style in plan.items():
        paths = [path for path in modules if _matches(path, pattern)]
        if not paths:
            raise ValueError(
                f"tensor-parallel plan entry {pattern!r} matches no module of "
                f"{type(module).__name__}"
            )
        for path in paths:
            replacement = style.apply(modules[path], comm, sequence_parallel)
            if replacement is not modules[path]:
                parent, _, name = path.rpartition(".")
                setattr(module.get_submodule(parent) if parent else module, name, replacement)
                modules[path] = replacement
    return module


_PLANS: dict[type, dict[str, Style]] = {}


def register_plan(cls: type, plan: dict[str, Style]) -> None:
    """The plan `parallelize` uses for models of class `cls` (and its subclasses)."""
    _PLANS[cls] = plan


def _registered_plan(module: nn.Module) -> Optional[dict[str, Style]]:
    for cls in type(module).__mro__:
        if cls in _PLANS:
            return _PLANS[cls]
    return None


def persistent_buffers(model: nn.Module):
    """(name, buffer) of the buffers a state dict holds: not the non-persistent ones (e.g. drop
    path's keep probability), which are rebuilt from the config."""
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


@torch.no_grad()
def full_state_dict(model: nn.Module, comm: Optional[TPComm]) -> dict[str, torch.Tensor]:
    """The canonical (unsharded) state dict, identical to the single-device model's, on every TP
    rank.

    Args:
        model: the model as laid out (its tensor-parallel shards marked).
        comm: the TP group; None: nothing is sharded.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in [*model.named_parameters(), *persistent_buffers(model)]:
        dim = getattr(tensor, SHARD_DIM, None)
        if dim is None or comm is None:
            out[name] = tensor.detach().clone()
            continue
        pieces = [torch.empty_like(tensor) for _ in range(comm.size)]
        torch.distributed.all_gather(pieces, tensor.detach().contiguous(), group=comm.group)
        out[name] = torch.cat(pieces, dim=dim)
    return out
