"""The training loop. It does not care which layout it got; it asks the `Layout` which rank logs and which group a
metric is reduced over, and takes its parts ready-built (`components.build_components`).

`Trainer.fit` runs the hooks (`hooks.default_hooks`, each owning its cadence) around one optimizer step
(`step.OptimizerStep`), epoch by epoch, until the last step, `trainer.stop_at_step` or a stop signal; checkpoints
and resuming are `resume.Checkpointing`'s; the start-up lines and the end-of-run summary are `summary.py`'s.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from visiondist.checkpoint.dcp import PendingSave, async_group
from visiondist.faults.health import StepHealth
from visiondist.observe.metrics import MetricsLogger
from visiondist.observe.summary import report_run
from visiondist.parallel import Layout, PipelinedViT, local_numel, reshard, same_buffers, unwrap
from visiondist.train.build import consolidate
from visiondist.train.components import Components, build_components
from visiondist.train.hooks import default_hooks
from visiondist.train.resume import Checkpointing, resume_path
from visiondist.train.step import OptimizerStep
from visiondist.train.summary import announce, run_summary
from visiondist.utils.heartbeat import PROGRESS
from visiondist.utils.signals import STOP

log = logging.getLogger(__name__)


class Trainer(Checkpointing, OptimizerStep):
    def __init__(self, cfg: DictConfig, layout: Layout, run_dir: Path, parts: Optional[Components] = None):
        """`parts`: the rank's components (default: `build_components`, with no initial weights when a checkpoint
        is to fill every tensor)."""
        self.cfg, self.layout, self.run_dir = cfg, layout, run_dir
        resume_from = resume_path(cfg, run_dir)
        if parts is None:
            parts = build_components(cfg, layout, checkpoint=resume_from)
        self.task, self.data = parts.task, parts.task.data
        self.model, self.optimizer, self.ema = parts.model, parts.optimizer, parts.ema
        self.scheduler, self.autocast, self.scaler = parts.scheduler, parts.autocast, parts.scaler
        self.total_steps, self.length, self.num_params = parts.total_steps, parts.length, parts.num_params
        self.pipeline = self.model if isinstance(self.model, PipelinedViT) else None
        self.bubble: float | None = None  # measured on one step of a pipelined run
        self.rank_params = sum(local_numel(p) for p in self.model.parameters())
        t = cfg.trainer
        self.step = 0
        self.epoch = 0
        self.last_eval: dict[str, Any] = {}
        self.tp_bytes_per_step: float | None = None  # ring bytes one rank sends in TP collectives per step
        self.pp_bytes_per_step: int | None = None  # bytes one rank sends to its pipeline neighbours per step
        self.progress = None  # the progress bar (rank 0, trainer.progress) while fit runs
        self.timer = None  # the step timer of the log lines (hooks.StepTimer) while fit runs
        self._peak_flops: tuple[float, float] | None = None  # (datasheet FLOP/s, training FLOPs per image): `mfu`
        self.stopping = False  # a hook asked the loop to end after this step
        self.final_loss = math.nan  # the last logged mean train loss
        self.weights: Path | None = None  # model.safetensors, once a complete run wrote it
        self.health = StepHealth(layout.world_size, layout.device)
        self.stop_requested = False
        self.skipped_steps = 0
        self.overflow_steps = 0  # fp16: steps skipped because a scaled gradient overflowed
        self.earlier_seconds: float | None = 0.0  # training seconds of the attempts before this one (None: unknown)
        self.resumed_from = self._resume(resume_from)
        self.last_checkpoint = self.resumed_from  # the newest complete checkpoint
        self.saved_step = self.step if self.resumed_from is not None else -1  # the step the newest save (any) is of
        self.pending_save: PendingSave | None = None  # trainer.checkpoint_async: the save being written
        self.checkpoint_stall_s: list[float] = []  # the seconds each save held up training
        self.best: dict | None = None  # trainer.best_metric: the best evaluated checkpoint of this process
        self._async_group = async_group(layout) if t.checkpoint_async else False
        self.resumed_from_step = self.step
        same_run = self.resumed_from is not None and self.resumed_from.parent.parent == run_dir
        self.metrics = MetricsLogger(run_dir, layout.is_main, t.loggers, self.task.columns,
                                     continue_from=self.step if same_run else None)

    @property
    def layout_text(self) -> str:
        return self.layout.run.describe()

    def evaluate(self) -> dict[str, Any]:
        PROGRESS.at("evaluating", self.step)
        same_buffers(self.model, self.layout)  # the first replica's BatchNorm statistics, which the checkpoint keeps
        ema_metrics = {}
        if self.ema is not None:  # first, so that files the evaluation writes (per_class.json) are the model's
            with self.ema.swapped(self.model):
                ema = self.task.evaluate(unwrap(self.model), self.layout, self.autocast, self.run_dir)
            ema_metrics = {f"val_ema_{k[4:]}": ema[k] for k in self.task.ema_keys}
        metrics = {**self.task.evaluate(unwrap(self.model), self.layout, self.autocast, self.run_dir), **ema_metrics}
        reshard(self.model)  # FSDP keeps the root's gathered weights after a forward without backward: free them
        self.last_eval = {**metrics, "step": self.step}
        self.metrics.log(self.step, epoch=self.epoch + 1, **metrics)  # counted from 1, as the log lines count
        log.info("eval  step %d | %s", self.step, self.task.describe(metrics))
        return metrics

    # -- the loop --------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """The loop: the hooks (`hooks.default_hooks`, each owning its cadence) around
        `train_step`, epoch by epoch, until the last step, `trainer.stop_at_step` or a stop signal. Rank 0's
        experiment trackers (`trainer.loggers`) run for its duration and end as it does: finished, stopped or
        failed."""
        try:
            self.metrics.start_trackers(self.cfg)
            return self._fit()
        except BaseException:
            self.metrics.close("failed")  # no tracker run (or its process) outlives a failed rank 0
            raise

    def _fit(self) -> dict[str, Any]:
        announce(self)
        hooks, sampler, t = default_hooks(), self.data.train_sampler, self.cfg.trainer
        end = min(self.total_steps, t.stop_at_step) if t.stop_at_step > 0 else self.total_steps  # of this process
        self.stopping, self.final_loss = False, math.nan
        try:
            for hook in hooks:
                hook.before_train(self)
            while self.step < end and not self.stopping:
                self.epoch, start = divmod(self.step, sampler.steps_per_epoch)
                sampler.set_epoch(self.epoch, start)
                with contextlib.ExitStack() as epoch:
                    batches = self.task.train_batches(self.layout.device)
                    if hasattr(batches, "close"):  # data.decode_on=device: its decoding thread
                        epoch.callback(batches.close)
                    for _ in range(min(sampler.steps_per_epoch - start, end - self.step)):
                        with contextlib.ExitStack() as around:
                            for hook in hooks:
                                around.enter_context(hook.step_context(self))
                            loss, grad_norm = self.train_step(batches)
                        self.step += 1
                        for hook in hooks:
                            hook.after_step(self, loss, grad_norm)
                            if self.stopping:
                                break
                        if self.stopping:
                            break
                self.epoch = self.step // sampler.steps_per_epoch
            self.settle()
        finally:
            for hook in hooks:
                hook.close(self)
        complete = self.step >= self.total_steps
        for hook in hooks:
            hook.after_train(self, complete)
        if complete:
            return self._finish(self.final_loss, self.timer.total_seconds, self.weights)
        why = f"{STOP.received or 'a signal to another rank'}" if self.stop_requested else "trainer.stop_at_step"
        log.info("stopped after step %d of %d (%s)", self.step, self.total_steps, why)  # the launcher says how to go on
        self.metrics.close("stopped")
        return {"stopped at step": self.step, "run dir": str(self.run_dir),
                **({"stopped by": STOP.received or "SIGTERM"} if self.stop_requested else {})}

    @contextlib.contextmanager
    def untimed(self):
        """Evaluations, checkpoints and the timeline's gathering: not counted as training time."""
        timer = self.timer
        if timer is not None:
            timer.pause()
        try:
            yield
        finally:
            if timer is not None:
                timer.resume()

    def groups(self) -> list:
        return [self.layout.mesh.get_group(dim) for dim in self.layout.mesh.mesh_dim_names]

    def reset_traffic(self) -> None:
        if self.layout.tp_comm is not None:
            self.layout.tp_comm.reset()
        if self.pipeline is not None:
            self.pipeline.p2p.reset()

    def peak_gpu_gib(self) -> float | None:
        """The most tensor memory this rank's GPU has held so far (None on the CPU)."""
        device = self.layout.device
        return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

    def mfu(self, images_per_s: float) -> float | None:
        """Model FLOPs utilisation of a training rate (images/s of the whole job): the model's training FLOPs per
        image (counted once) times the rate per device, over the device's dense datasheet peak in the step's matmul
        precision. None on the CPU, on a GPU the datasheet table does not know, and for detectors and native-resolution
        ViTs (their FLOPs change with each image's size)."""
        device = self.layout.device
        if device.type != "cuda" or self.cfg.model.family != "vit" or self.cfg.data.get("resolution") == "native":
            return None
        if self._peak_flops is None:
            from visiondist.models.flops import classifier_train_flops
            from visiondist.utils.peaks import datasheet_tflops, peak_kind

            t = self.cfg.trainer
            peak = datasheet_tflops(torch.cuda.get_device_name(device), peak_kind(t.precision, t.tf32, device))
            self._peak_flops = (peak * 1e12, classifier_train_flops(self.cfg.model)) if peak else (0.0, 0.0)
        peak, per_image = self._peak_flops
        return per_image * images_per_s / self.layout.world_size / peak if peak else None

    def save_weights(self) -> Path:
        """model.safetensors in the run dir, consolidated by rank 0 from the final checkpoint (`consolidate`)."""
        PROGRESS.at("writing the weights", self.step)
        return consolidate(self.cfg.model, self.last_checkpoint, self.run_dir / "model.safetensors", self.layout.is_main)

    def _finish(self, final_loss: float, train_time: float, weights: Path) -> dict[str, Any]:
        summary = run_summary(self, final_loss, train_time, weights)

        def written(pngs: list[Path]) -> None:  # the trackers get the plots and the weights, then end their runs
            self.metrics.log_files(pngs, weights, self.step)
            self.metrics.close()

        if self.layout.is_main:
            t = self.cfg.trainer  # twice the length that ended the run
            longer = (f"trainer.max_steps={2 * t.max_steps}" if self.length.startswith("trainer.max_steps") else
                      f"trainer.max_epochs={2 * t.max_epochs}")
            report_run(self.run_dir, summary, self.metrics.rows, self.task, self.last_eval,
                       f"{self.cfg.model.name} on {self.cfg.data.name}", written, self.cfg.trainer.plots, longer)
        self.metrics.close()
        return summary
