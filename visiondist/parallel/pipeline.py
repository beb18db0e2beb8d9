"""Pipeline parallelism for the ViT on `torch.distributed.pipelining`.

The plain model is cut into `pp x stages_per_rank` contiguous stages of blocks, balanced by parameter count; the
patch embedding, class token and position embedding go to the first stage, the final norm and the head to the last.
A stage module holds the model's own submodules under the model's attribute names (`blocks` keeps the global block
indices), so its parameter names are the single-device ones and checkpoints stay canonical whatever `pp` is.

Rank `r` of the PP group holds stages r, r + pp, r + 2 pp, ... (the looped placement that torch's interleaved and
zero-bubble schedules expect). The schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble) comes from
torch; this module only cuts, places and validates.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")  # several (virtual) stages per rank


def _params(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def stage_costs(model: nn.Module) -> list[int]:
    """Per-unit cost along the model: [embedding, block 0, ..., block N-1, norm + head]."""
    embed = _params(model.patch_embed) + model.cls_token.numel() + model.pos_embed.numel()
    return [embed, *(_params(b) for b in model.blocks), _params(model.norm) + _params(model.head)]


def balance(costs: Sequence[int], n: int) -> list[tuple[int, int]]:
    """Cut `costs` into `n` non-empty contiguous ranges [start, end) minimising the largest range's sum."""
    if n > len(costs):
        raise ValueError(f"cannot cut {len(costs)} units into {n} stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest max-load of cutting units [0, i) into k ranges; exact DP (N and n are small)
    inf = float("inf")
    best = [[inf] * (len(costs) + 1) for _ in range(n + 1)]
    cut = [[0] * (len(costs) + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, n + 1):
        for i in range(k, len(costs) + 1):
            for j in range(k - 1, i):
                load = max(best[k - 1][j], prefix[i] - prefix[j])
                if load < best[k][i]:
                    best[k][i], cut[k][i] = load, j
    ranges, i = [], len(costs)
    for k in range(n, 0, -1):
        j = cut[k][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


def block_ranges(model: nn.Module, n_stages: int) -> list[tuple[int, int]]:
    """Blocks [first, last) of each stage. Units are [embed, blocks..., head]; the embedding joins the first stage
    and the head the last, each stage keeps at least one block."""
    depth = len(model.blocks)
    if n_stages > depth:
        raise ValueError(f"{n_stages} pipeline stages need at least as many blocks; the model has {depth}")
    costs = stage_costs(model)
    blocks = list(costs[1:-1])
    blocks[0] += costs[0]
    blocks[-1] += costs[-1]
    return balance(blocks, n_stages)


class ViTStage(nn.Module):
    """Blocks [first, last) of a VisionTransformer, with the embedding when first and the head when last."""

    def __init__(self, model: nn.Module, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.patch_embed, self.cls_token, self.pos_embed = model.patch_embed, model.cls_token, model.pos_embed
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, last)})
        if is_last:
            self.norm, self.head_drop, self.head = model.norm, model.head_drop, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.patch_embed(x)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.head(self.head_drop(self.norm(x)[:, 0]))
        return x


def stage_indices(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages a rank holds: looped placement."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def build_stages(model: nn.Module, pp_rank: int, pp: int, stages_per_rank: int) -> list[ViTStage]:
    n = pp * stages_per_rank
    ranges = block_ranges(model, n)
    return [ViTStage(model, *ranges[s], s == 0, s == n - 1) for s in stage_indices(pp_rank, pp, stages_per_rank)]


def build_schedule(name: str, stages: list[ViTStage], stage_ids: list[int], n_stages: int, microbatches: int,
                   device: torch.device, group, loss_fn: Callable):
    """torch's schedule `name` over this rank's stages."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
               "zero_bubble": ScheduleInterleavedZeroBubble}
    if name not in classes:
        raise ValueError(f"parallel.schedule={name!r}: choose one of {', '.join(classes)}")
    pipe_stages = [PipelineStage(m, s, n_stages, device, group=group) for m, s in zip(stages, stage_ids)]
    if name in MULTI_STAGE:
        return classes[name](pipe_stages, n_microbatches=microbatches, loss_fn=loss_fn)
    if len(pipe_stages) != 1:
        raise ValueError(f"parallel.schedule={name} runs one stage per rank: set parallel.stages_per_rank=1")
    return classes[name](pipe_stages[0], n_microbatches=microbatches, loss_fn=loss_fn)
