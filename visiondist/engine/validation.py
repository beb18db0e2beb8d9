"""The evaluations a training run makes of its own model (and of its EMA), on the val split, between
steps: a part the loop holds, the owner of the loop state's `last_eval`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from visiondist.engine.components import Components
from visiondist.engine.state import LoopState
from visiondist.observe.metrics import MetricsLogger
from visiondist.parallel import Layout, reshard, same_buffers, unwrap
from visiondist.utils.heartbeat import PROGRESS

log = logging.getLogger(__name__)


class Validation:
    def __init__(
        self,
        layout: Layout,
        run_dir: Path,
        parts: Components,
        state: LoopState,
        metrics: MetricsLogger,
    ):
        self.layout, self.run_dir, self.parts, self.state, self.metrics = (
            layout,
            run_dir,
            parts,
            state,
            metrics,
        )

    def evaluate(self) -> dict[str, Any]:
        """The model's metrics on the val split at this step (and its EMA's, as `val_ema_*`):
        logged, recorded in metrics.csv and kept as the loop state's `last_eval`. Every rank calls
        it (the evaluation is collective)."""
        parts, state = self.parts, self.state
        PROGRESS.at("evaluating", state.step)
        # the first replica's BatchNorm statistics, which the checkpoint keeps
        same_buffers(parts.model, self.layout)
        model, task = unwrap(parts.model), parts.task
        ema_metrics = {}
        # first, so that files the evaluation writes (per_class.json) are the model's
        if parts.ema is not None:
            with parts.ema.swapped(parts.model):
                ema = task.evaluate(model, self.layout, parts.autocast, self.run_dir)
            ema_metrics = {f"val_ema_{k[4:]}": ema[k] for k in task.ema_keys}
        metrics = {**task.evaluate(model, self.layout, parts.autocast, self.run_dir), **ema_metrics}
        # FSDP keeps the root's gathered weights after a forward without backward: free them
        reshard(parts.model)
        state.last_eval = {**metrics, "step": state.step}
        # the epoch of the step evaluated, counted from 1 as the log lines count (an evaluation at
        # an epoch's end runs once the loop has moved on to the next)
        epoch = (
            (state.step - 1) // parts.data.train_sampler.steps_per_epoch + 1 if state.step else 1
        )
        self.metrics.log(state.step, epoch=epoch, **metrics)
        log.info("eval  step %d | %s", state.step, task.describe(metrics))
        return metrics
