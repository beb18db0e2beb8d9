"""The interface of a training hook (`visiondist.train.hooks` holds the hooks and their order)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ContextManager

import torch

if TYPE_CHECKING:
    from visiondist.train.trainer import Trainer


class Hook:
    def before_train(self, trainer: "Trainer") -> None: ...

    def step_context(self, trainer: "Trainer") -> ContextManager:
        """Entered around the next step (e.g. to record its timeline)."""
        return contextlib.nullcontext()

    def after_step(self, trainer: "Trainer", loss: torch.Tensor, grad_norm: torch.Tensor) -> None: ...

    def after_train(self, trainer: "Trainer", complete: bool) -> None:
        """`complete`: the run reached its last step (otherwise it stopped early: a signal or trainer.stop_at_step)."""

    def close(self, trainer: "Trainer") -> None:
        """Always called, also when a step raised."""
