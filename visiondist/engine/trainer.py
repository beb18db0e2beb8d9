"""The training loop and the interface of the hooks it runs.

The loop is handed everything (`visiondist.engine.run.build_trainer` builds it): the parts (model,
optimizer, data, ...), the optimizer step, the checkpoints, the evaluation, one `LoopState`, and the
hooks in their order. It does not care which layout it got, names no hook, and decides nothing a
hook decides: per step it runs the optimizer step inside each hook's `step_context`, then each
hook's `after_step`, epoch by epoch, until the last step, `trainer.stop_at_step` or a hook ending
the loop (a stop signal).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager, Iterator, Optional, Sequence

import torch
from omegaconf import DictConfig

from visiondist.engine.checkpointing import Checkpointing
from visiondist.engine.components import Components
from visiondist.engine.state import LoopState, StepTimer
from visiondist.engine.step import OptimizerStep
from visiondist.engine.utilisation import Utilisation
from visiondist.engine.validation import Validation
from visiondist.observe.metrics import MetricsLogger
from visiondist.parallel import Layout


class Hook:
    """One concern of the loop with its own cadence (detectron2's HookBase). Each method gets the
    `Trainer`: its parts, its `state` (which a hook writes only in the fields it owns) and its
    `untimed()`."""

    def before_train(self, trainer: Trainer) -> None:
        """Once, before the first step of this process.

        Args:
            trainer: the loop that runs this hook.
        """

    def step_context(self, trainer: Trainer) -> ContextManager[Any]:
        """Entered around the next step (e.g. to record its timeline).

        Args:
            trainer: the loop that runs this hook; `trainer.state.step` counts the steps done.

        Returns:
            A context manager the loop enters before the step and leaves after it.
        """
        return contextlib.nullcontext()

    def after_step(
        self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor
    ) -> Optional[bool]:
        """After each step (`trainer.state.step` counts it). True ends the loop after this step: the
        hooks after this one do not see it.

        Args:
            trainer: the loop that runs this hook.
            loss: the step's mean loss of this DP rank's samples (on the device: reading it waits
                for the step).
            grad_norm: the step's global gradient norm (on the device).

        Returns:
            True to end the loop after this step; None or False to go on.
        """
        return None

    def after_train(self, trainer: Trainer, complete: bool) -> None:
        """Once, after the loop ended (after every hook's `close`).

        Args:
            trainer: the loop that runs this hook.
            complete: the run reached its last step (otherwise it stopped early: a signal or
                trainer.stop_at_step).
        """

    def close(self, trainer: Trainer) -> None:
        """Always called when the loop ends, also when a step raised; before `after_train`.

        Args:
            trainer: the loop that runs this hook.
        """


@dataclass
class Trainer:
    """The loop and what it holds. Built by the layer above (`run.build_trainer`), which also
    reports the run.

    Args:
        cfg: the run's resolved config (read-only).
        layout: this rank's place in the device mesh, carrying the resolved `RunLayout`.
        run_dir: the run directory.
        parts: the rank's parts (`components.Components`: task and data, model, optimizer, ...).
        state: the loop state it starts from (`LoopState.starting_from`).
        optimizer_step: one optimizer step over the parts (`step.OptimizerStep`).
        checkpoints: resuming and saving (`checkpointing.Checkpointing`).
        validation: the evaluations between steps (`validation.Validation`).
        metrics: metrics.csv and the experiment trackers (`MetricsLogger`).
        utilisation: MFU and the memory peak of a training rate (`utilisation.Utilisation`).
        hooks: the hooks in the order they run (`hooks.default_hooks` gives the default one).
    """

    cfg: DictConfig
    layout: Layout
    run_dir: Path
    parts: Components
    state: LoopState
    optimizer_step: OptimizerStep
    checkpoints: Checkpointing
    validation: Validation
    metrics: MetricsLogger
    utilisation: Utilisation
    hooks: Sequence[Hook] = field(default_factory=list)

    def train(self) -> bool:
        """Step until the last step of this process (`trainer.stop_at_step` ends it sooner) or a
        hook ends the loop; returns whether the run reached its last step."""
        state, sampler, t = self.state, self.parts.data.train_sampler, self.cfg.trainer
        total = self.parts.total_steps
        end = min(total, t.stop_at_step) if t.stop_at_step > 0 else total
        state.timer = StepTimer(self.layout.device)
        try:
            for hook in self.hooks:
                hook.before_train(self)
            stopped = False
            while state.step < end and not stopped:
                state.epoch, start = divmod(state.step, sampler.steps_per_epoch)
                sampler.set_epoch(state.epoch, start)
                stopped = self._epoch(min(sampler.steps_per_epoch - start, end - state.step))
                state.epoch = state.step // sampler.steps_per_epoch
            self.optimizer_step.settle()
        finally:
            for hook in self.hooks:
                hook.close(self)
        complete = state.step >= total
        for hook in self.hooks:
            hook.after_train(self, complete)
        return complete

    def _epoch(self, steps: int) -> bool:
        """`steps` steps of the epoch the sampler is set to; returns whether a hook ended the
        loop."""
        with contextlib.ExitStack() as epoch:
            loaded = self.parts.task.train_batches(self.layout.device)
            if hasattr(loaded, "close"):  # data.decode_on=device: its decoding thread
                epoch.callback(loaded.close)
            assert self.state.timer is not None  # `train` starts it
            batches = self.state.timer.fed(loaded)
            for _ in range(steps):
                with contextlib.ExitStack() as around:
                    for hook in self.hooks:
                        around.enter_context(hook.step_context(self))
                    loss, grad_norm = self.optimizer_step.train_step(batches)
                self.state.step += 1
                # in order, up to the first
                if any(hook.after_step(self, loss, grad_norm) for hook in self.hooks):
                    return True
        return False

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Evaluations, checkpoints and the timeline's gathering: not counted as training time."""
        timer = self.state.timer
        with timer.untimed() if timer is not None else contextlib.nullcontext():
            yield
