"""Cutting a model of blocks into pipeline stages: the model declares what goes with the first and
the last stage (`StageCut`, registered beside the model), the blocks are balanced by parameter count
(`balance`, exact: the arithmetic the memory plan cuts by too, in `visiondist.config.layout`), and
each `Stage` holds the model's own parts under the model's attribute names (`blocks` keeps the
global block indices), so parameter names are the single-device ones whatever `pp` is. Rank `r` of
the PP group holds stages r, r + pp, ... (`stage_indices`: the looped placement torch's interleaved
and zero-bubble schedules expect)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from visiondist.config.layout import balance


@dataclass(frozen=True)
class StageCut:
    """How a model family is cut into pipeline stages, declared beside the model
    (`register_stage_cut`): the attributes that travel with the first stage (before the blocks:
    embeddings) and with the last (after them: norm, head), what the first stage does before its
    blocks (`enter(stage, images)`) and the last after them (`leave(stage, tokens)`), and the first
    stage's tensors exempt from weight decay. The blocks are `model.blocks`."""

    first: tuple[str, ...]
    last: tuple[str, ...]
    # the model's own methods, called with a stage (an nn.Module holding the model's parts under
    # their names) in the model's place
    enter: Callable[[Any, torch.Tensor], torch.Tensor]
    leave: Callable[[Any, torch.Tensor], torch.Tensor]
    no_weight_decay: tuple[str, ...] = ()


_CUTS: dict[type, StageCut] = {}


def register_stage_cut(cls: type, cut: StageCut) -> None:
    _CUTS[cls] = cut


def stage_cut(model: nn.Module) -> StageCut:
    for cls in type(model).__mro__:
        if cls in _CUTS:
            return _CUTS[cls]
    raise ValueError(
        f"{type(model).__name__} declares no pipeline stage cut (visiondist.parallel.stages."
        "register_stage_cut, beside the model)"
    )


def model_blocks(model: nn.Module) -> nn.Sequential:
    """`model.blocks`, the blocks in order (an `nn.Sequential` in every family that declares a
    `StageCut`)."""
    blocks = model.blocks
    if not isinstance(blocks, nn.Sequential):
        raise TypeError(
            f"{type(model).__name__}.blocks is a {type(blocks).__name__}; a pipeline cuts an "
            "nn.Sequential of blocks"
        )
    return blocks


def _numel(part) -> int:
    return (
        part.numel()
        if isinstance(part, torch.Tensor)
        else sum(p.numel() for p in part.parameters())
    )


def stage_costs(model: nn.Module) -> list[int]:
    """Per-unit cost along the model: [what precedes the blocks, block 0, ..., block N-1, what
    follows them]."""
    cut = stage_cut(model)
    return [
        sum(_numel(getattr(model, name)) for name in cut.first),
        *(_numel(b) for b in model_blocks(model)),
        sum(_numel(getattr(model, name)) for name in cut.last),
    ]


def block_ranges(model: nn.Module, n_stages: int) -> list[tuple[int, int]]:
    """Blocks [first, last) of each stage. Units are [embed, blocks..., head]; the embedding joins
    the first stage and the head the last, each stage keeps at least one block."""
    depth = len(model_blocks(model))
    if n_stages > depth:
        raise ValueError(
            f"{n_stages} pipeline stages need at least as many blocks; the model has {depth}"
        )
    costs = stage_costs(model)
    blocks = list(costs[1:-1])
    blocks[0] += costs[0]
    blocks[-1] += costs[-1]
    return balance(blocks, n_stages)


# -- stages ----------------------------------------------------------------------------------------


class StageBlocks(nn.ModuleDict):
    """A stage's blocks under their global indices (`blocks.<i>.` names), run in order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.values():
            x = block(x)
        return x


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: a stage's input gradient is sent to
    the previous stage as is, and P2P sends need contiguous tensors (under sequence parallelism it
    is a slice of a padded gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class Stage(nn.Module):
    """Blocks [first, last) of a model, with what precedes the blocks when first and what follows
    them when last (the model's `StageCut`), under the model's own attribute names."""

    def __init__(self, model: nn.Module, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.is_first, self.is_last, self.cut = is_first, is_last, stage_cut(model)
        take_parts(self, model, self.cut.first if is_first else ())
        blocks = model_blocks(model)
        self.blocks = StageBlocks({str(i): blocks[i] for i in range(first, last)})
        take_parts(self, model, self.cut.last if is_last else ())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.cut.enter(self, x)
        elif x.requires_grad:
            x = _ContiguousGrad.apply(x)
        x = self.blocks(x)
        if self.is_last:
            return self.cut.leave(self, x)
        return x.contiguous()  # sent to the next stage as is


def take_parts(holder: nn.Module, model: nn.Module, names: Sequence[str]) -> None:
    """The model's submodules / parameters `names`, registered on `holder` under the same names."""
    for name in names:
        setattr(holder, name, getattr(model, name))


def stage_indices(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages a rank holds: looped placement."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def build_stages(
    model: nn.Module,
    pp_rank: int,
    pp: int,
    stages_per_rank: int,
    ranges: Optional[list[tuple[int, int]]] = None,
) -> list[Stage]:
    """This rank's stages; `ranges`: the cut (default `block_ranges` of the model)."""
    n = pp * stages_per_rank
    ranges = ranges or block_ranges(model, n)
    return [
        Stage(model, *ranges[s], s == 0, s == n - 1)
        for s in stage_indices(pp_rank, pp, stages_per_rank)
    ]
