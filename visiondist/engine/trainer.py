"""The training loop. It does not care which layout it got; it asks the `Layout` which rank logs and which group a
metric is reduced over.

One optimizer step = `trainer.grad_accum` micro-batches per DP rank (gradient sync only on the last, via DDP's
`no_sync`), a global gradient norm (clipped if asked), the optimizer and the LR schedule. Under fp16
(`trainer.precision=16`) the loss is scaled before the backward and the gradients unscaled before the norm; a step
whose gradient overflowed is skipped on every rank (`visiondist.engine.precision`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig

from visiondist.engine.build import (
    build_laid_out,
    check_val_images,
    consolidate,
    num_params,
    precision_text,
    run_length,
    run_of,
    seed_everything,
)
from visiondist.engine.checkpoint import (
    PendingSave,
    async_group,
    latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from visiondist.engine.ema import ModelEma
from visiondist.engine.hooks import default_hooks
from visiondist.engine.failures import PROGRESS
from visiondist.engine.faults import STOP, NonFiniteStep, StepHealth
from visiondist.engine.logging import MetricsLogger
from visiondist.engine.optim import build_optimizer, build_scheduler, warmup_length
from visiondist.engine.precision import LossScaler, autocast_for, precision_name
from visiondist.engine.report import report_run, run_summary
from visiondist.engine.tasks import build_task
from visiondist.parallel import (
    Layout,
    PipelinedViT,
    average_over_data_parallel,
    clip_grad_norm,
    finish_gradients,
    local_numel,
    reshard,
    unwrap,
)

log = logging.getLogger(__name__)

class Trainer:
    def __init__(self, cfg: DictConfig, layout: Layout, run_dir: Path):
        self.cfg, self.layout, self.run_dir = cfg, layout, run_dir
        run_of(layout)  # every parallel switch is read from the resolved layout, never from cfg.parallel
        t = cfg.trainer
        seed_everything(t.seed)  # the same on every rank: identical initial weights before any broadcast
        self.task = build_task(cfg, layout)  # the data first: a missing folder stops the run before a model is built
        self.data = self.task.data
        check_val_images(self.data.val_loader)  # before step 1, not at the first evaluation
        resume_from = self._resume_path()  # a checkpoint fills every tensor: then no initial weights are read
        self.model = build_laid_out(cfg, layout, getattr(self.task, "criterion", None),  # a pipeline's last stage
                                    weights=resume_from is None)
        self.num_params = num_params(cfg.model)
        self.pipeline = self.model if isinstance(self.model, PipelinedViT) else None
        self.bubble: float | None = None  # measured on one step of a pipelined run
        self.rank_params = sum(local_numel(p) for p in self.model.parameters())
        self.optimizer = build_optimizer(cfg.optim, unwrap(self.model), cfg.model.depth)  # over this rank's shards
        self.ema = ModelEma(unwrap(self.model), t.ema_decay) if t.ema_decay > 0 else None

        self.total_steps, self.length = run_length(t, self.data.train_sampler.steps_per_epoch)
        total = self.total_steps
        self.scheduler = build_scheduler(cfg.schedule, self.optimizer, total)
        self.autocast = autocast_for(t.precision, layout.device)
        self.scaler = LossScaler(layout.device) if precision_name(t.precision) == "16" else None
        self.step = 0
        self.epoch = 0
        self.last_eval: dict[str, Any] = {}
        self.tp_bytes_per_step: float | None = None  # ring bytes one rank sends in TP collectives per step
        self.pp_bytes_per_step: int | None = None  # bytes one rank sends to its pipeline neighbours per step
        self.progress = None  # the progress bar (rank 0, trainer.progress) while fit runs
        self.timer = None  # the step timer of the log lines (engine.hooks.StepTimer) while fit runs
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

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def _resume(self, path: Path | None) -> Path | None:
        """Load `path` (`_resume_path`) into model, optimizer, schedule, step / data position and, under the same
        layout, the RNG states."""
        if path is None:
            return None
        saved = load_checkpoint(path, unwrap(self.model), self.optimizer, self.layout, self.ema)
        if self.ema is not None and not saved["ema_restored"]:
            self.ema.reset()
            log.info("the checkpoint has no EMA: the average starts from its weights")
        self.scheduler.load_state_dict({"lr_lambdas": [None] * len(self.optimizer.param_groups), **saved["scheduler"]})
        self.step = int(saved["step"])
        self.earlier_seconds = saved.get("train_seconds")  # absent: a checkpoint that did not count them
        self.epoch = self.step // self.data.train_sampler.steps_per_epoch
        if self.scaler is not None:
            if saved.get("grad_scaler"):  # one value for the whole job, whatever the layout either run had
                self.scaler.load_state_dict(saved["grad_scaler"])
            else:
                log.info("the checkpoint is not from an fp16 run: the loss scale starts at %g", self.scaler.get_scale())
        if saved.get("total_steps") != self.total_steps:
            log.warning("the checkpoint's run had %s steps, this one has %d: the LR schedule follows this run's",
                        saved.get("total_steps"), self.total_steps)
        log.info("resumed from %s: step %d, epoch %d + %d steps%s", path, self.step, self.epoch,
                 self.step % self.data.train_sampler.steps_per_epoch,
                 "" if saved["rng_restored"] else
                 f" (saved with layout {saved.get('layout')}: random states restart from the seed)")
        if not saved["rng_restored"]:
            seed_everything(self.cfg.trainer.seed + self.step)
        return path

    def _resume_path(self) -> Path | None:
        """The checkpoint `trainer.resume` names (auto: this run dir's latest complete one), or None."""
        spec = self.cfg.trainer.resume
        if spec is None:
            return None
        return latest_checkpoint(self.run_dir) if spec == "auto" else resolve_checkpoint(str(spec))

    def save_checkpoint(self, wait: bool = False) -> Path:
        """A checkpoint of this step. Under `trainer.checkpoint_async` the write continues in the background (at most
        one in flight: a previous one is waited for first) unless `wait`; returns its final path either way."""
        import time

        started = time.perf_counter()
        self.wait_checkpoint()
        self.settle()  # never save the weights of a step that turns out to have been non-finite
        PROGRESS.at("saving a checkpoint", self.step)
        reshard(self.model)  # FSDP: the parameters must be the sharded ones the optimizer holds
        state = {
            "epoch": self.epoch,
            "total_steps": self.total_steps,
            # the run's training seconds up to this step, over every attempt (a continued run's summary adds to it)
            **({"train_seconds": self.earlier_seconds + (self.timer.total_seconds if self.timer else 0.0)}
               if self.earlier_seconds is not None else {}),
            "scheduler": self.scheduler.state_dict(),  # LambdaLR: numbers only (its lambdas are rebuilt)
            "model": self.cfg.model.name,
            "data": self.cfg.data.name,
            "classes": list(self.data.classes),
            # detection: the COCO category id of labels 1..K (the export's label map)
            **({"category_ids": [cat for _, cat in sorted(self.data.cat_of_label.items())]}
               if hasattr(self.data, "cat_of_label") else {}),
            **({"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {}),  # scale, growth tracker
        }
        saved = save_checkpoint(self.run_dir, self.step, unwrap(self.model), self.optimizer, state, self.layout,
                                self.cfg.trainer.keep_last, self.ema, async_group=self._async_group)
        self.saved_step = self.step
        if isinstance(saved, PendingSave):
            self.pending_save = saved
            if wait:
                self.wait_checkpoint()
        else:
            self.last_checkpoint = saved
            log.info("checkpoint: %s", saved)
        self.checkpoint_stall_s.append(time.perf_counter() - started)
        return saved.path if isinstance(saved, PendingSave) else saved

    def wait_checkpoint(self) -> None:
        """Wait for the save in flight (if any) to be complete on disk; it becomes the newest checkpoint."""
        pending = self.pending_save
        if pending is None:
            return
        self.last_checkpoint = pending.wait()
        self.pending_save = None
        log.info("checkpoint: %s (written in the background)", pending.path)

    @property
    def layout_text(self) -> str:
        return self.layout.run.describe()

    # -- one optimizer step --------------------------------------------------------------------------------------
    def train_step(self, batches: Iterator) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over grad_accum micro-batches (or pipeline steps), then clip and step. Returns (mean loss
        of this DP rank's samples, global grad norm)."""
        PROGRESS.at("training", self.step + 1)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is None:
            total = self._accumulate(batches)
        else:
            total = self._accumulate_pipelined(batches)
        finish_gradients(self.model.parameters(), self.layout)
        if self.scaler is not None:  # the norm, clipping and the optimizer see the true gradients
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.trainer.clip_grad, self.layout)
        self.health.submit(self.step + 1, self.layout.rank, total, grad_norm, self.signals_received())
        if self.scaler is not None:  # skip and back off on the job's verdict, never on this rank's alone
            self.scaler.agree(self.optimizer, self.health.nonfinite())
        if self.cfg.trainer.on_nonfinite == "skip":  # the optimizer step depends on this step's verdict: wait for it
            verdict = self.health.verdict()
            self._act_on(verdict)
            if verdict.finite or self._overflow(verdict):
                self._optimizer_step()
        else:  # step now; the verdict of the previous step is read once this one is queued (no wait on the device)
            self._optimizer_step()
            if self.health.pending > 1:
                self._act_on(self.health.verdict())
        if self.scaler is not None:
            self.scaler.update()
        self.scheduler.step()
        return total, grad_norm

    def _optimizer_step(self) -> None:
        """The optimizer and EMA update. Under fp16 the scaler skips the optimizer's update when the step's verdict
        is not finite; the EMA is updated all the same (toward unchanged weights), as in timm's and torchvision's
        references, so that no host read is needed."""
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
        if self.ema is not None:
            self.ema.update()

    def _overflow(self, verdict) -> bool:
        """fp16: a scaled gradient overflowed (every loss finite, the gradient not). Expected while the scale
        calibrates; the scaler skips the step on every rank and halves the scale."""
        return self.scaler is not None and verdict.bad_grad and not verdict.bad_loss_ranks

    def settle(self) -> None:
        """Act on every step verdict still in flight (before a checkpoint, at the end of the loop)."""
        while self.health.pending:
            self._act_on(self.health.verdict())

    @staticmethod
    def signals_received() -> bool:
        return STOP.received is not None

    def _act_on(self, verdict) -> None:
        """Every rank takes the same decision (the flags were all-reduced): stop after this step, raise, or skip this
        optimizer step."""
        self.stop_requested = self.stop_requested or verdict.stop
        if verdict.finite:
            return
        if self._overflow(verdict):  # already skipped by the scaler, on the device: count it, never raise
            self.overflow_steps += 1
            log.info("fp16 gradient overflow at step %d: optimizer step skipped on every rank, loss scale halved "
                     "(overflows so far: %d)", verdict.step, self.overflow_steps)
            return
        ranks = verdict.bad_loss_ranks
        if ranks:
            where = (f"non-finite loss at step {verdict.step} on rank{'s' if len(ranks) > 1 else ''} "
                     f"{', '.join(map(str, ranks))}")
        else:
            where = f"non-finite gradient at step {verdict.step} (the loss was finite on every rank)"
        if self.cfg.trainer.on_nonfinite == "raise":
            PROGRESS.at(step=verdict.step)  # read one step late: the failure is that step's
            fp16 = ", or trainer.precision=bf16 / 32 (fp16 overflows above 65504)" if self.scaler is not None else ""
            raise NonFiniteStep(f"{where}: lower optim.lr, set trainer.clip_grad{fp16}, or trainer.on_nonfinite=skip "
                                "to skip such steps")
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        log.warning("skipped the optimizer step (non-finite loss or gradient) at %s; %d skipped so far", where,
                    self.skipped_steps)

    def _accumulate(self, batches: Iterator) -> torch.Tensor:
        """Gradients of grad_accum micro-batches; DDP all-reduces during the last backward only."""
        accum = self.cfg.trainer.grad_accum
        total = torch.zeros((), device=self.layout.device)
        for i in range(accum):
            batch = next(batches)
            last = i == accum - 1
            sync = nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            with sync:
                loss = self.task.loss(self.model, batch, self.layout.device, self.autocast, (self.step, i)) / accum
                (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            total += loss.detach()
        return total

    def _accumulate_pipelined(self, batches: Iterator) -> torch.Tensor:
        """grad_accum pipeline steps (each `parallel.microbatches` micro-batches), then the DP average."""
        accum = self.cfg.trainer.grad_accum
        total = torch.zeros((), device=self.layout.device)
        factor = None if self.scaler is None else self.scaler.factor(self.layout.device)
        for i in range(accum):  # the first stage prepares (and mixes) the images, the last the targets: same draw
            images, target = self.task.prepare(next(batches), self.layout.device, (self.step, i))
            if factor is None:
                total += self.pipeline.train_step(images, target, 1.0 / accum, self.autocast)
            else:  # fp16: the loss inside the schedule carries the scale (a power of 2: dividing it out is exact)
                total += self.pipeline.train_step(images, target, factor / accum, self.autocast) / factor
        average_over_data_parallel(self.model.parameters(), self.layout)
        return total

    def evaluate(self) -> dict[str, Any]:
        PROGRESS.at("evaluating", self.step)
        ema_metrics = {}
        if self.ema is not None:  # first, so that files the evaluation writes (per_class.json) are the model's
            with self.ema.swapped(self.model):
                ema = self.task.evaluate(unwrap(self.model), self.layout, self.autocast, self.run_dir)
            ema_metrics = {f"val_ema_{k[4:]}": ema[k] for k in self.task.ema_keys}
        metrics = {**self.task.evaluate(unwrap(self.model), self.layout, self.autocast, self.run_dir), **ema_metrics}
        reshard(self.model)  # FSDP keeps the root's gathered weights after a forward without backward: free them
        self.last_eval = {**metrics, "step": self.step}
        self.metrics.log(self.step, epoch=self.epoch, **metrics)
        log.info("eval  step %d | %s", self.step, self.task.describe(metrics))
        return metrics

    # -- the loop --------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """The loop: the hooks (`visiondist.engine.hooks.default_hooks`, each owning its cadence) around
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
        self._announce()
        hooks, sampler, t = default_hooks(), self.data.train_sampler, self.cfg.trainer
        end = min(self.total_steps, t.stop_at_step) if t.stop_at_step > 0 else self.total_steps  # of this process
        self.stopping, self.final_loss = False, math.nan
        try:
            for hook in hooks:
                hook.before_train(self)
            while self.step < end and not self.stopping:
                self.epoch, start = divmod(self.step, sampler.steps_per_epoch)
                sampler.set_epoch(self.epoch, start)
                batches = iter(self.data.train_loader)
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

    def _announce(self) -> None:
        t, sampler = self.cfg.trainer, self.data.train_sampler
        log.info(
            "model %s: %.2fM parameters (%.2fM on this rank) | layout %s | precision %s | global batch %d (%d per rank "
            "x %d accumulation) | %d steps (%s)",
            self.cfg.model.name, self.num_params / 1e6, self.rank_params / 1e6, self.layout_text,
            precision_text(t, self.layout.device), self.cfg.data.batch_size, sampler.micro_batch, t.grad_accum,
            self.total_steps, self.length,
        )
        if t.max_steps > self.total_steps and self.layout.is_main:
            log.warning("trainer.max_steps=%d is not reached: %s; raise trainer.max_epochs (or set it to 0) to train "
                        "%d steps", t.max_steps, self.length, t.max_steps)
        if precision_name(t.precision) == "16" and self.layout.device.type == "cpu":
            log.warning("trainer.precision=16 on the CPU: CPUs have no fp16 matrix units, so a step takes many times "
                        "the fp32 one (18.9x for ViT-Ti on 2 AMD EPYC cores, benchmarks/RESULTS.md); fp16 is for GPUs "
                        "without bf16 (V100, T4): here use trainer.precision=bf16 or 32")
        if sampler.dropped_per_epoch:
            log.info("training uses %d of %d images per epoch (%d global batches of %d); %d, a different random set "
                     "each epoch, wait for the next%s", sampler.steps_per_epoch * self.cfg.data.batch_size,
                     self.data.num_train, sampler.steps_per_epoch, self.cfg.data.batch_size, sampler.dropped_per_epoch,
                     " (incomplete aspect-ratio batches)" if sampler.groups is not None else "")
        s, warmup = self.cfg.schedule, warmup_length(self.cfg.schedule, self.total_steps)
        if warmup < s.warmup_steps and self.layout.is_main:
            log.warning("schedule.warmup_steps=%d is not shorter than the run (%d step%s): the warmup is cut to %d "
                        "step%s; set schedule.warmup_steps below the run's steps", s.warmup_steps, self.total_steps,
                        "" if self.total_steps == 1 else "s", warmup, "" if warmup == 1 else "s")
        if self.layout.world_size > 1:
            nodes = len(set(self.layout.nodes))
            log.info("mesh (pp, dp, tp) over %d node%s: %s", nodes, "s" if nodes > 1 else "",
                     "; ".join(self.layout.placement()))
        if self.pipeline is not None:
            log.info("%s", self.pipeline.describe())

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
            report_run(self.run_dir, summary, self.metrics.rows, self.task, self.last_eval,
                       f"{self.cfg.model.name} on {self.cfg.data.name}", written)
        self.metrics.close()
        return summary
