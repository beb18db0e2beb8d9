"""The hooks that decide what a run leaves: its checkpoints (every `trainer.checkpoint_every` steps,
the best by `trainer.best_metric`, the last), its consolidated weights, and the evaluations the best
is chosen by. `default.py` orders them among the others.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Optional

import torch

from visiondist.checkpoint.files import mark_best, read_best
from visiondist.engine.build import consolidate
from visiondist.engine.trainer import Hook, Trainer
from visiondist.faults.health import set_collective_timeout
from visiondist.utils.heartbeat import PROGRESS

log = logging.getLogger(__name__)


class CheckpointHook(Hook):
    """Every `trainer.checkpoint_every` steps and every `trainer.checkpoint_every_min` minutes
    before the last, and at the end of the run (complete or stopped) unless that step is saved
    already. The minutes are rank 0's clock, carried in the step's verdict (`StepHealth`, no other
    collective): every rank saves after the same step, a step after rank 0's clock said so (two
    when the verdicts are read a step late). Under `trainer.checkpoint_async` a save overlaps the
    next steps; the end of the run, a stop and a failure wait for it (a failure at most
    `trainer.dist_timeout_s`). Owns `state.save_wanted_here`."""

    def __init__(self) -> None:
        self._since = time.monotonic()  # the clock of the newest checkpoint
        self._saved_at = 0  # its step

    def before_train(self, trainer: Trainer) -> None:
        self._since, self._saved_at = time.monotonic(), trainer.state.step

    def after_step(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        t, state = trainer.cfg.trainer, trainer.state
        every, step = t.checkpoint_every, state.step
        due = (bool(every) and step % every == 0) or state.save_due > self._saved_at
        if due and step < trainer.parts.total_steps:
            with trainer.untimed():
                trainer.checkpoints.save()
        # any save restarts the clock (this one, the best evaluated, ...): the same step everywhere
        if trainer.checkpoints.saved_step > self._saved_at:
            self._since, self._saved_at = time.monotonic(), trainer.checkpoints.saved_step
        minutes = float(t.get("checkpoint_every_min", 0))
        if minutes > 0 and trainer.layout.is_main:
            state.save_wanted_here = time.monotonic() - self._since >= minutes * 60

    def close(self, trainer: Trainer) -> None:
        """Also after a failure: the save in flight is finished, so that a restart resumes from
        it."""
        pending = trainer.checkpoints.pending
        if pending is not None:
            try:
                pending.wait(trainer.cfg.trainer.dist_timeout_s)
            except Exception as exc:  # after_train raises it on a run that did not fail otherwise
                log.warning("%s", exc)

    def after_train(self, trainer: Trainer, complete: bool) -> None:
        checkpoints = trainer.checkpoints
        checkpoints.wait()
        if checkpoints.saved_step != trainer.state.step:
            checkpoints.save(wait=True)


class BestCheckpointHook(Hook):
    """`trainer.best_metric`: after each evaluation that improves the metric, that step's checkpoint
    (saved now if the cadence did not) is recorded in checkpoints/best.json and kept beside the
    newest `trainer.keep_last` (detectron2's BestCheckpointer). A resumed run continues from the
    best it had. Owns `state.best`."""

    def __init__(self) -> None:
        self.metric: Optional[str] = None
        self.mode = "max"
        self.best: Optional[float] = None
        self.checked = -1

    def before_train(self, trainer: Trainer) -> None:
        t, state = trainer.cfg.trainer, trainer.state
        self.metric, self.checked = t.best_metric, state.step
        if self.metric is None:
            return
        self.mode = (
            t.best_mode if t.best_mode != "auto" else ("min" if "loss" in self.metric else "max")
        )
        best = read_best(trainer.run_dir)
        self.best = best["value"] if best and best.get("metric") == self.metric else None
        # the evaluation a stop skipped, run now
        if state.step and state.last_eval.get("step") == state.step:
            self.checked = -1
            self._check(trainer)

    def after_step(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self._check(trainer)

    def after_train(self, trainer: Trainer, complete: bool) -> None:
        self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        state, checkpoints = trainer.state, trainer.checkpoints
        if (
            self.metric is None
            or state.last_eval.get("step") != state.step
            or self.checked == state.step
        ):
            return
        self.checked = state.step
        value = state.last_eval.get(self.metric)
        if value is None or not math.isfinite(value):
            return
        if self.best is not None and (
            value <= self.best if self.mode == "max" else value >= self.best
        ):
            return
        self.best = value
        with trainer.untimed():
            if checkpoints.saved_step != state.step:
                checkpoints.save()
        record = {"metric": self.metric, "mode": self.mode, "value": value, "step": state.step}
        state.best = record
        log.info("best %s so far: %.6g at step %d", self.metric, value, state.step)
        if not trainer.layout.is_main:
            return
        keep, run_dir, pending = trainer.cfg.trainer.keep_last, trainer.run_dir, checkpoints.pending
        if pending is not None and pending.step == state.step:
            pending.then(lambda: mark_best(run_dir, record, keep))
        else:
            mark_best(run_dir, record, keep)


class WeightsHook(Hook):
    """A complete run's model.safetensors, consolidated by rank 0 from the final checkpoint
    (`build.consolidate`) while the other ranks wait (under the start-up timeout: minutes for a huge
    model). Owns `state.weights`."""

    def after_train(self, trainer: Trainer, complete: bool) -> None:
        if not complete:
            return
        t, lay, checkpoint = (
            trainer.cfg.trainer,
            trainer.layout,
            trainer.checkpoints.last_checkpoint,
        )
        assert checkpoint is not None  # CheckpointHook saved the last step
        PROGRESS.at("writing the weights", trainer.state.step)
        trainer.state.weights = consolidate(
            trainer.cfg.model, checkpoint, trainer.run_dir / "model.safetensors", lay.is_main
        )
        if lay.world_size > 1:
            set_collective_timeout(
                t.startup_timeout_s, lay.groups(), quiet=True, key="trainer.startup_timeout_s"
            )
            torch.distributed.barrier()
            set_collective_timeout(t.dist_timeout_s, lay.groups(), quiet=True)


class EvalHook(Hook):
    """`trainer.eval_at_start`; every `trainer.eval_every` steps (0: every epoch, -1: none between);
    and at the end of a complete run unless its last step was evaluated. A stop signal that reached
    any rank before a due evaluation ends the loop instead: a stopped job spends nothing more than
    its checkpoint."""

    def before_train(self, trainer: Trainer) -> None:
        step = trainer.state.step
        if trainer.cfg.trainer.eval_at_start and step == 0:
            with trainer.untimed():
                trainer.validation.evaluate()
        elif 0 < step < trainer.parts.total_steps and self.due(trainer) and self._skipped(trainer):
            log.info(
                "step %d's evaluation did not run before the run stopped (a stop signal during "
                "that step): it runs now, before step %d",
                step,
                step + 1,
            )
            with trainer.untimed():
                trainer.validation.evaluate()

    @staticmethod
    def due(trainer: Trainer) -> bool:
        """Whether the step just run is one the cadence evaluates after."""
        every, step = trainer.cfg.trainer.eval_every, trainer.state.step
        end_of_epoch = step % trainer.parts.data.train_sampler.steps_per_epoch == 0
        if every < 0:  # only the end of the run's (`after_train`)
            return False
        return bool((every and step % every == 0) or (not every and end_of_epoch))

    @staticmethod
    def _skipped(trainer: Trainer) -> bool:
        """A run continued in its own run dir whose metrics.csv (rank 0's) has no evaluation of this
        step, agreed by every rank (one all-reduce: the evaluation is collective)."""
        if not trainer.state.resumed.same_run(trainer.run_dir):
            return False
        key, lay = trainer.parts.task.headline[0], trainer.layout
        logged = any(
            r.get("step") == trainer.state.step and r.get(key) is not None
            for r in trainer.metrics.rows
        )
        missing = torch.tensor([0.0 if lay.is_main and logged else 1.0], device=lay.device)
        if lay.world_size > 1:  # rank 0 holds the rows: its "logged" decides
            torch.distributed.all_reduce(missing, op=torch.distributed.ReduceOp.MIN)
        return bool(missing.item())

    def after_step(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        # the last step's evaluation runs in after_train, once the checkpoint and the weights are
        # written
        if self.due(trainer) and trainer.state.step < trainer.parts.total_steps:
            # a stop: its checkpoint, not a pass over the val set first
            if trainer.optimizer_step.agree_stop():
                return True  # (the signal may have come during this step)
            with trainer.untimed():
                trainer.validation.evaluate()
        return False

    def after_train(self, trainer: Trainer, complete: bool) -> None:
        if complete and trainer.state.last_eval.get("step") != trainer.state.step:
            trainer.validation.evaluate()
