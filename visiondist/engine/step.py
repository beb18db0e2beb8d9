"""One optimizer step of the training loop: `trainer.grad_accum` micro-batches per DP rank (gradient
sync only on the last, via DDP's `no_sync`) or pipeline steps, a global gradient norm (clipped if
asked), the optimizer, the EMA and the LR schedule. Under fp16 (`trainer.precision=16`) the loss is
scaled before the backward and the gradients unscaled before the norm; a step whose gradient
overflowed is skipped on every rank (`precision.LossScaler`).

Every step's health (`visiondist.faults.health.StepHealth`: non-finite loss per rank, non-finite
gradient, a stop signal, a checkpoint due) is one all-reduce; every rank takes the same decision
on it (`trainer.on_nonfinite`: raise or skip)."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterator

import torch
from omegaconf import DictConfig

from visiondist.engine.build import run_of
from visiondist.engine.components import Components
from visiondist.engine.state import LoopState
from visiondist.faults.health import NonFiniteStep, StepHealth, Verdict
from visiondist.parallel import (
    Layout,
    PipelinedViT,
    average_over_data_parallel,
    clip_grad_norm,
    finish_gradients,
)
from visiondist.utils.heartbeat import PROGRESS
from visiondist.utils.signals import STOP

log = logging.getLogger(__name__)


def signals_received() -> bool:
    """Whether a stop signal (SIGTERM, SIGINT) reached this process."""
    return STOP.received is not None


class OptimizerStep:
    """A part the loop holds: it steps the parts' model, optimizer, scaler, EMA and schedule, and
    owns the step verdicts' fields of the loop state (`stop_requested`, `stop_asked`, `save_due`,
    `skipped_steps`, `overflow_steps`). It needs no run dir: the benchmark times it as it is."""

    def __init__(self, cfg: DictConfig, layout: Layout, parts: Components, state: LoopState):
        self.cfg, self.layout, self.parts, self.state = cfg, layout, parts, state
        self.health = StepHealth(layout.world_size, layout.device)
        self.model, self.pipeline, self.optimizer = parts.model, parts.pipeline, parts.optimizer
        self.scaler = parts.scaler

    def train_step(self, batches: Iterator) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over grad_accum micro-batches (or pipeline steps), then clip and step.
        Returns (mean loss of this DP rank's samples, global grad norm)."""
        PROGRESS.at("training", self.state.step + 1)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipeline is None:
            total = self._accumulate(batches)
        else:
            total = self._accumulate_pipelined(batches, self.pipeline)
        finish_gradients(self.model.parameters(), self.layout)
        if self.scaler is not None:  # the norm, clipping and the optimizer see the true gradients
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.trainer.clip_grad, self.layout)
        self.health.submit(
            self.state.step + 1,
            self.layout.rank,
            total,
            grad_norm,
            signals_received(),
            self.state.stop_asked_here is not None,
            self.state.save_wanted_here,
        )
        # skip and back off on the job's verdict, never on this rank's alone
        if self.scaler is not None:
            self.scaler.agree(self.optimizer, self.health.nonfinite())
        # the optimizer step depends on this step's verdict: wait for it
        if self.cfg.trainer.on_nonfinite == "skip":
            verdict = self._next_verdict()
            self._act_on(verdict)
            if verdict.finite or self._overflow(verdict):
                self._optimizer_step()
        # step now; the verdict of the previous step is read once this one is queued (no wait on the
        # device)
        else:
            self._optimizer_step()
            if self.health.pending > 1:
                self._act_on(self._next_verdict())
        if self.scaler is not None:
            self.scaler.update()
        # the peak group's (the head's under optim.layer_decay; the first group is the patch
        # embedding's, layer_decay ** (depth + 1) of it), as this step used it: the log's lr
        self.state.step_lr = max(group["lr"] for group in self.optimizer.param_groups)
        self.parts.scheduler.step()
        return total, grad_norm

    def _optimizer_step(self) -> None:
        """The optimizer and EMA update. Under fp16 the scaler skips the optimizer's update when the
        step's verdict is not finite; the EMA is updated all the same (toward unchanged weights), as
        in timm's and torchvision's references, so that no host read is needed."""
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
        if self.parts.ema is not None:
            self.parts.ema.update()

    def _overflow(self, verdict: Verdict) -> bool:
        """fp16: a scaled gradient overflowed (every loss finite, the gradient not). Expected while
        the scale calibrates; the scaler skips the step on every rank and halves the scale."""
        return self.scaler is not None and verdict.bad_grad and not verdict.bad_loss_ranks

    def settle(self) -> None:
        """Act on every step verdict still in flight (before a checkpoint, at the end of the
        loop)."""
        while self.health.pending:
            self._act_on(self._next_verdict())

    def _next_verdict(self) -> Verdict:
        """The oldest submitted step's verdict (waits for it); one is pending."""
        verdict = self.health.verdict()
        if verdict is None:
            raise RuntimeError("no step verdict is pending")
        return verdict

    def agree_stop(self) -> bool:
        """Whether a stop signal has reached any rank by now, agreed by all (one all-reduce: every
        rank asks at the same step). Asked before long work between steps (an evaluation), which the
        step flags, read a step late, would not spare."""
        flag = torch.tensor([float(signals_received())], device=self.layout.device)
        if self.layout.world_size > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        self.state.stop_requested = self.state.stop_requested or bool(flag.item())
        return self.state.stop_requested

    def _act_on(self, verdict: Verdict) -> None:
        """Every rank takes the same decision (the flags were all-reduced): stop after this step,
        raise, or skip this optimizer step."""
        state = self.state
        state.stop_requested = state.stop_requested or verdict.stop
        state.stop_asked = state.stop_asked or verdict.asked
        if verdict.save:
            state.save_due = verdict.step
        if verdict.finite:
            return
        # already skipped by the scaler, on the device: count it, never raise
        if self._overflow(verdict):
            state.overflow_steps += 1
            log.info(
                "fp16 gradient overflow at step %d: optimizer step skipped on every rank, loss "
                "scale halved (overflows so far: %d)",
                verdict.step,
                state.overflow_steps,
            )
            return
        ranks = verdict.bad_loss_ranks
        if ranks:
            where = (
                f"non-finite loss at step {verdict.step} on rank{'s' if len(ranks) > 1 else ''} "
                f"{', '.join(map(str, ranks))}"
            )
        else:
            where = (
                f"non-finite gradient at step {verdict.step} (the loss was finite on every rank)"
            )
        if self.cfg.trainer.on_nonfinite == "raise":
            PROGRESS.at(step=verdict.step)  # read one step late: the failure is that step's
            fp16 = (
                ", or trainer.precision=bf16 / 32 (fp16 overflows above 65504)"
                if self.scaler is not None
                else ""
            )
            clip = self.cfg.trainer.clip_grad
            clipping = (
                f"lower trainer.clip_grad (now {clip:g})" if clip > 0 else "set trainer.clip_grad"
            )
            raise NonFiniteStep(
                f"{where}: lower optim.lr, {clipping}{fp16}, or trainer.on_nonfinite=skip to skip "
                "such steps"
            )
        self.optimizer.zero_grad(set_to_none=True)
        state.skipped_steps += 1
        log.warning(
            "skipped the optimizer step (non-finite loss or gradient) at %s; %d skipped so far",
            where,
            state.skipped_steps,
        )

    def _accumulate(self, batches: Iterator) -> torch.Tensor:
        """Gradients of grad_accum micro-batches; DDP all-reduces during the last backward only."""
        accum = self.cfg.trainer.grad_accum
        total = torch.zeros((), device=self.layout.device)
        # DDP's: no gradient all-reduce in the backwards before the last
        no_sync: Callable[[], ContextManager[Any]] | None = getattr(self.model, "no_sync", None)
        for i in range(accum):
            batch = next(batches)
            last = i == accum - 1
            sync = nullcontext() if last or no_sync is None else no_sync()
            # a new iteration of the CUDA graphs: the last one's outputs are dead
            if run_of(self.layout).cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with sync:
                loss = (
                    self.parts.task.loss(
                        self.model,
                        batch,
                        self.layout.device,
                        self.parts.autocast,
                        (self.state.step, i),
                    )
                    / accum
                )
                (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            total += loss.detach()
        return total

    def _accumulate_pipelined(self, batches: Iterator, pipeline: PipelinedViT) -> torch.Tensor:
        """grad_accum pipeline steps (each `parallel.microbatches` micro-batches), then the DP
        average."""
        accum = self.cfg.trainer.grad_accum
        total = torch.zeros((), device=self.layout.device)
        factor = None if self.scaler is None else self.scaler.factor(self.layout.device)
        # the first stage prepares (and mixes) the images, the last the targets: same draw
        for i in range(accum):
            images, target = self.parts.task.prepare(
                next(batches), self.layout.device, (self.state.step, i)
            )
            if factor is None:
                total += pipeline.train_step(images, target, 1.0 / accum, self.parts.autocast)
            # fp16: the loss inside the schedule carries the scale (a power of 2: dividing it out is
            # exact)
            else:
                total += (
                    pipeline.train_step(images, target, factor / accum, self.parts.autocast)
                    / factor
                )
        average_over_data_parallel(self.model.parameters(), self.layout)
        return total
