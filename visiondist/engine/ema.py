"""Exponential moving average of the weights (model EMA), for any layout.

Each rank averages the parameters it holds: its TP shards, its pipeline stages, or the whole model
under DDP (where every replica holds the same values). No rank needs the full model, so the EMA
costs one extra copy of the rank's parameters, and it is checkpointed with canonical names like the
parameters themselves. `timm.utils.ModelEmaV3` deep-copies the whole module instead, which a sharded
or pipelined model (holding process groups and schedules) cannot be.

Evaluation swaps the averages into the live parameters and back (`swapped()`); buffers (BatchNorm
statistics) are the live model's.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from visiondist.parallel.fsdp import reshard


class ModelEma:
    def __init__(self, model: nn.Module, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay {decay} must be in (0, 1)")
        self.decay = decay
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """shadow <- decay * shadow + (1 - decay) * param, after each optimizer step."""
        if self.shadow:
            torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1.0 - self.decay)

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average from the current weights (a checkpoint without EMA state)."""
        for s, p in zip(self.shadow, self.params):
            s.copy_(p)

    def named_shadows(self) -> Iterator[tuple[str, torch.Tensor, nn.Parameter]]:
        return zip(self.names, self.shadow, self.params)

    @torch.no_grad()
    def _swap(self) -> None:
        for s, p in zip(self.shadow, self.params):
            live = p.detach().clone()
            p.copy_(s)
            s.copy_(live)

    @contextmanager
    def swapped(self, model: nn.Module | None = None):
        """The averaged weights in the model for the duration of the block. Under FSDP, `model`'s
        gathered weights are freed around each swap so that no forward sees stale copies."""
        sync = (lambda: reshard(model)) if model is not None else (lambda: None)
        sync()
        self._swap()
        try:
            yield
        finally:
            sync()
            self._swap()
