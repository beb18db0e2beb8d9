"""The hooks that decide what a run leaves: its checkpoints (every `trainer.checkpoint_every` steps, the best by
`trainer.best_metric`, the last), its consolidated weights, and the evaluations the best is chosen by. `hooks.py`
orders them among the others (`default_hooks`).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from visiondist.faults.health import set_collective_timeout
from visiondist.train.hook import Hook

if TYPE_CHECKING:
    from visiondist.train.trainer import Trainer

log = logging.getLogger(__name__)


class CheckpointHook(Hook):
    """Every `trainer.checkpoint_every` steps before the last, and at the end of the run (complete or stopped) unless
    that step is saved already. Under `trainer.checkpoint_async` a save overlaps the next steps; the end of the run,
    a stop and a failure wait for it (a failure at most `trainer.dist_timeout_s`)."""

    def after_step(self, trainer, loss, grad_norm):
        every = trainer.cfg.trainer.checkpoint_every
        if every and trainer.step % every == 0 and trainer.step < trainer.total_steps:
            with trainer.untimed():
                trainer.save_checkpoint()

    def close(self, trainer):
        """Also after a failure: the save in flight is finished, so that a restart resumes from it."""
        if trainer.pending_save is not None:
            try:
                trainer.pending_save.wait(trainer.cfg.trainer.dist_timeout_s)
            except Exception as exc:  # after_train raises it on a run that did not fail otherwise
                log.warning("%s", exc)

    def after_train(self, trainer, complete):
        trainer.wait_checkpoint()
        if trainer.saved_step != trainer.step:
            trainer.save_checkpoint(wait=True)


class BestCheckpointHook(Hook):
    """`trainer.best_metric`: after each evaluation that improves the metric, that step's checkpoint (saved now if
    the cadence did not) is recorded in checkpoints/best.json and kept beside the newest `trainer.keep_last`
    (detectron2's BestCheckpointer). A resumed run continues from the best it had."""

    def before_train(self, trainer):
        from visiondist.checkpoint.files import read_best

        t = trainer.cfg.trainer
        self.metric, self.checked = t.best_metric, trainer.step
        if self.metric is None:
            return
        self.mode = t.best_mode if t.best_mode != "auto" else ("min" if "loss" in self.metric else "max")
        best = read_best(trainer.run_dir)
        self.best = best["value"] if best and best.get("metric") == self.metric else None
        if trainer.step and trainer.last_eval.get("step") == trainer.step:  # the evaluation a stop skipped, run now
            self.checked = -1
            self._check(trainer)

    def after_step(self, trainer, loss, grad_norm):
        self._check(trainer)

    def after_train(self, trainer, complete):
        self._check(trainer)

    def _check(self, trainer) -> None:
        if self.metric is None or trainer.last_eval.get("step") != trainer.step or self.checked == trainer.step:
            return
        self.checked = trainer.step
        value = trainer.last_eval.get(self.metric)
        if value is None or not math.isfinite(value):
            return
        if self.best is not None and (value <= self.best if self.mode == "max" else value >= self.best):
            return
        self.best = value
        from visiondist.checkpoint.files import mark_best

        with trainer.untimed():
            if trainer.saved_step != trainer.step:
                trainer.save_checkpoint()
        record = {"metric": self.metric, "mode": self.mode, "value": value, "step": trainer.step}
        trainer.best = record
        log.info("best %s so far: %.6g at step %d", self.metric, value, trainer.step)
        if not trainer.layout.is_main:
            return
        keep = trainer.cfg.trainer.keep_last
        if trainer.pending_save is not None and trainer.pending_save.step == trainer.step:
            trainer.pending_save.then(lambda: mark_best(trainer.run_dir, record, keep))
        else:
            mark_best(trainer.run_dir, record, keep)


class WeightsHook(Hook):
    """A complete run's model.safetensors, consolidated by rank 0 from the final checkpoint while the other ranks
    wait (under the start-up timeout: minutes for a huge model)."""

    def after_train(self, trainer, complete):
        if not complete:
            return
        t = trainer.cfg.trainer
        trainer.weights = trainer.save_weights()
        if trainer.layout.world_size > 1:
            set_collective_timeout(t.startup_timeout_s, trainer.groups(), quiet=True, key="trainer.startup_timeout_s")
            torch.distributed.barrier()
            set_collective_timeout(t.dist_timeout_s, trainer.groups(), quiet=True)


def stop_agreed(trainer: Trainer) -> bool:
    """Whether a stop signal has reached any rank by now, agreed by all (one all-reduce: every rank asks at the same
    step). Asked before long work between steps (an evaluation), which the step flags, read a step late, would not
    spare."""
    flag = torch.tensor([float(trainer.signals_received())], device=trainer.layout.device)
    if trainer.layout.world_size > 1:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    trainer.stop_requested = trainer.stop_requested or bool(flag.item())
    return trainer.stop_requested


class EvalHook(Hook):
    """`trainer.eval_at_start`; every `trainer.eval_every` steps (0: every epoch); and at the end of a complete run
    unless its last step was evaluated."""

    def before_train(self, trainer):
        if trainer.cfg.trainer.eval_at_start and trainer.step == 0:
            trainer.evaluate()
        elif 0 < trainer.step < trainer.total_steps and self.due(trainer) and self._skipped(trainer):
            log.info("step %d's evaluation did not run before the run stopped (a stop signal during that step): "
                     "it runs now, before step %d", trainer.step, trainer.step + 1)
            with trainer.untimed():
                trainer.evaluate()

    @staticmethod
    def due(trainer) -> bool:
        """Whether the step just run is one the cadence evaluates after."""
        every = trainer.cfg.trainer.eval_every
        end_of_epoch = trainer.step % trainer.data.train_sampler.steps_per_epoch == 0
        return bool((every and trainer.step % every == 0) or (not every and end_of_epoch))

    @staticmethod
    def _skipped(trainer) -> bool:
        """A run continued in its own run dir whose metrics.csv (rank 0's) has no evaluation of this step, agreed by
        every rank (one all-reduce: the evaluation is collective)."""
        same_run = trainer.resumed_from is not None and trainer.resumed_from.parent.parent == trainer.run_dir
        if not same_run:
            return False
        key = trainer.task.headline[0]
        logged = any(r.get("step") == trainer.step and r.get(key) is not None for r in trainer.metrics.rows)
        missing = torch.tensor([0.0 if trainer.layout.is_main and logged else 1.0], device=trainer.layout.device)
        if trainer.layout.world_size > 1:  # rank 0 holds the rows: its "logged" decides
            torch.distributed.all_reduce(missing, op=torch.distributed.ReduceOp.MIN)
        return bool(missing.item())

    def after_step(self, trainer, loss, grad_norm):
        # the last step's evaluation runs in after_train, once the checkpoint and the weights are written
        if self.due(trainer) and trainer.step < trainer.total_steps:
            if stop_agreed(trainer):  # a stop: its checkpoint, not a pass
                trainer.stopping = True  # over the val set first (the signal may have come during this step)
                return
            with trainer.untimed():
                trainer.evaluate()

    def after_train(self, trainer, complete):
        if complete and trainer.last_eval.get("step") != trainer.step:
            trainer.evaluate()
