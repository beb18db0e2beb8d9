"""A user's own callbacks in the loop (`visiondist.train(callbacks=[...])`): objects with any of
`on_train_start(state)`, `on_step_end(state)`, `on_eval_end(state)`, `on_train_end(state)`, run on
every rank by one hook, `CallbackHook`, last in the loop's order (after the checkpoint, the
evaluation and the best checkpoint: a callback sees what the step left). `state` is a read-only
`CallbackState`; `state.stop()` asks the run to stop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from visiondist.engine.trainer import Hook, Trainer

# what a callback may define, each called with a `CallbackState`
EVENTS = ("on_train_start", "on_step_end", "on_eval_end", "on_train_end")


@dataclass(frozen=True)
class CallbackState:
    """The run as a callback sees it, on its rank (read-only: the loop's own state is not handed
    out, so that no callback can break the run by writing it).

    Args:
        step: optimizer steps done.
        epoch: the epoch the next step is in, from 0.
        total_steps: the steps of the whole run.
        rank: this process's global rank.
        world_size: the job's ranks.
        run_dir: the run directory.
        loss: the last logged mean train loss over the data-parallel ranks (nan before the first
            log line: `trainer.log_every`).
        metrics: the latest evaluation's figures (e.g. `val_top1`, `val_map`) with its "step"; empty
            before the first.
        complete: on_train_end: the run reached its last step (else it stopped early).
    """

    step: int
    epoch: int
    total_steps: int
    rank: int
    world_size: int
    run_dir: Path
    loss: float = math.nan
    metrics: dict[str, Any] = field(default_factory=dict)
    complete: bool = False
    _ask: Optional[Callable[[str], None]] = field(default=None, repr=False, compare=False)

    def stop(self, reason: str = "") -> None:
        """Ask the run to stop: every rank stops at the same step boundary (the request travels with
        the step's health flags, which are read a step late: at most two steps later), writes its
        checkpoint and ends the run as `trainer.stop_at_step` would; the run continues later from
        that checkpoint (`Run.resume`).

        Args:
            reason: said in the run's last line after the callback's class name.
        """
        if self._ask is not None:
            self._ask(reason)


class CallbackHook(Hook):
    """The user's callbacks, each event in the order they were given. Owns the loop state's
    `stop_asked_here`. A callback that raises fails its rank, as a failing step would."""

    def __init__(self, callbacks: Sequence[Any]):
        self.callbacks = list(callbacks)
        self.seen_eval: Optional[dict] = None
        self.seen_step: Optional[int] = None  # the last step on_step_end was called for
        self.asked: Optional[str] = None
        self.calling: Any = None  # the callback being called

    def _view(self, trainer: Trainer, complete: bool = False) -> CallbackState:
        state, layout = trainer.state, trainer.layout
        return CallbackState(
            step=state.step,
            epoch=state.epoch,
            total_steps=trainer.parts.total_steps,
            rank=layout.rank,
            world_size=layout.world_size,
            run_dir=Path(trainer.run_dir),
            loss=state.final_loss,
            metrics=dict(state.last_eval),
            complete=complete,
            _ask=self._ask_for(),
        )

    def _ask_for(self) -> Callable[[str], None]:
        current = self

        def ask(reason: str) -> None:
            if current.asked is None:  # the first request is the one the run's last line names
                name = type(current.calling).__name__
                current.asked = f"{name} asked to stop" + (f": {reason}" if reason else "")

        return ask

    def _call(self, event: str, trainer: Trainer, complete: bool = False) -> None:
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if method is None:
                continue
            self.calling = callback
            method(self._view(trainer, complete))
        if event == "on_step_end":
            self.seen_step = trainer.state.step
        if self.asked is not None and trainer.state.stop_asked_here is None:
            trainer.state.stop_asked_here = self.asked

    def _evaluated(self, trainer: Trainer) -> None:
        """on_eval_end, once for each evaluation the loop made since the last call."""
        last = trainer.state.last_eval
        if last and last is not self.seen_eval:
            self.seen_eval = last
            self._call("on_eval_end", trainer)

    def before_train(self, trainer: Trainer) -> None:
        self._call("on_train_start", trainer)
        self._evaluated(trainer)  # trainer.eval_at_start

    def after_step(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self._call("on_step_end", trainer)
        self._evaluated(trainer)

    def after_train(self, trainer: Trainer, complete: bool) -> None:
        # the step a stop ended the loop after: the hooks before this one ended it
        stepped = trainer.state.step > trainer.state.resumed.step
        if stepped and self.seen_step != trainer.state.step:
            self._call("on_step_end", trainer)
        self._evaluated(trainer)  # the last step's evaluation
        self._call("on_train_end", trainer, complete)
