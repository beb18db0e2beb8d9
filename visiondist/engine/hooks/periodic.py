"""The loop's periodic and cross-cutting concerns, one class each, each owning its cadence and its
fields of the loop state: the progress bar, the collective timeout, the stop check, the traffic
counters, the log line and the pipeline timeline. `default.py` orders them among the others.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from typing import Any, ContextManager, Optional

import torch
import torch.distributed as dist

from visiondist.engine.build import run_of
from visiondist.engine.state import StepTimer
from visiondist.engine.trainer import Hook, Trainer
from visiondist.faults.health import set_collective_timeout
from visiondist.observe.console import in_terminal
from visiondist.observe.progress import fed, in_notebook, progress_bar
from visiondist.parallel import Layout, PipelinedViT
from visiondist.parallel.timeline import bubble_fraction, plot_timeline, to_json

# a log line names the share of the window the step waited for its input from this share on
DATA_WAIT_SHOWN = 0.1
# the windows after the first (the workers' start) that waited this much of their time, over at
# least DATA_WAIT_STEPS steps and DATA_WAIT_SECONDS, are warned of, once (a tiny run's one-step
# windows say little)
DATA_WAIT_WARNED = 0.3
DATA_WAIT_STEPS = 20
DATA_WAIT_SECONDS = 10.0

log = logging.getLogger(__name__)


class ProgressHook(Hook):
    """The rich progress bar on the main rank (`trainer.progress`), in a terminal or a notebook
    (`observe.progress`): into a pipe or a file a bar is one cut-off line at the end, and the log
    lines already say how far the run is; there, this process's first step gets a line of its own
    when it has no log line
    (`trainer.log_every` apart, the first can be minutes away) and no compile line (`CompileHook`).
    Owns `state.progress`."""

    def __init__(self) -> None:
        self.started: Optional[float] = None  # when training began, until the first step's line

    def before_train(self, trainer: Trainer) -> None:
        t, lay = trainer.cfg.trainer, trainer.layout
        # a terminal's bar, a notebook's widget, or the launching kernel's (`observe.progress`)
        shown = t.progress and lay.is_main and (in_terminal() or in_notebook() or fed())
        trainer.state.progress = progress_bar(shown, trainer.parts.total_steps)
        quiet = not shown and lay.is_main and t.log_every > 1 and not run_of(lay).compile
        self.started = time.perf_counter() if quiet else None

    def after_step(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        state, total = trainer.state, trainer.parts.total_steps
        if state.progress is not None:
            state.progress.update(0, completed=state.step)
        if self.started is not None:
            t = trainer.cfg.trainer
            if state.step % t.log_every and state.step not in (total, t.stop_at_step):
                log.info(
                    "training: step %d/%d done after %.1f s (the first batches included); a line "
                    "every %d steps (trainer.log_every)",
                    state.step,
                    total,
                    time.perf_counter() - self.started,
                    t.log_every,
                )
            self.started = None

    def close(self, trainer: Trainer) -> None:
        if trainer.state.progress is not None:
            trainer.state.progress.stop()


class TimeoutHook(Hook):
    """After the first step of this process (start-up, compilation and first collectives are over),
    collectives time out after `trainer.dist_timeout_s`: a hang fails fast. Said on the console
    where there are ranks to wait for (one rank's collectives wait on nobody)."""

    def after_step(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if trainer.state.step == trainer.state.resumed.step + 1:
            set_collective_timeout(
                trainer.cfg.trainer.dist_timeout_s,
                trainer.layout.groups(),
                quiet=trainer.layout.world_size == 1,
            )


class StopHook(Hook):
    """A stop signal on any rank, or a callback's request (the step's all-reduced flags), ends the
    loop after this step."""

    def after_step(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        state = trainer.state
        return (state.stop_requested or state.stop_asked) and state.step < trainer.parts.total_steps


def reset_traffic(layout: Layout, pipeline: Optional[PipelinedViT]) -> None:
    """Zero the TP collectives' and the pipeline sends' byte counters."""
    if layout.tp_comm is not None:
        layout.tp_comm.reset()
    if pipeline is not None:
        pipeline.p2p.reset()


class TrafficHook(Hook):
    """Bytes one step moves through TP collectives and pipeline sends, noted once (every step moves
    the same). A pipeline's first step also runs the schedule's shape inference, so its second step
    is counted. Owns `state.tp_bytes_per_step` and `state.pp_bytes_per_step`."""

    def __init__(self) -> None:
        self.noted = False

    def before_train(self, trainer: Trainer) -> None:
        reset_traffic(trainer.layout, trainer.parts.pipeline)

    def after_step(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if self.noted:
            return
        state, comm, pipe = trainer.state, trainer.layout.tp_comm, trainer.parts.pipeline
        if pipe is not None and state.step == state.resumed.step + 1:
            reset_traffic(trainer.layout, pipe)
            return
        self.noted = True
        if comm is not None:
            state.tp_bytes_per_step = comm.ring_bytes()
            calls = ", ".join(f"{n} {kind}" for kind, n in sorted(comm.calls.items()))
            log.info(
                "tensor parallel traffic: %.2f MB sent per rank per step (%s)",
                state.tp_bytes_per_step / 1e6,
                calls,
            )
        if pipe is not None:
            state.pp_bytes_per_step = pipe.p2p.bytes
            log.info(
                "pipeline traffic: %.2f MB sent per rank per step (%d sends to neighbouring "
                "stages)",
                pipe.p2p.bytes / 1e6,
                pipe.p2p.sends,
            )


class LogHook(Hook):
    """Every `trainer.log_every` steps, at the last and at a stop (signal or
    `trainer.stop_at_step`): the mean loss over DP, grad norm, LR, images/s and the share of the
    window the step waited for its input (`data_wait`, the mean over DP ranks) to the metrics (CSV,
    TensorBoard), the console and the progress bar. Owns `state.final_loss`."""

    def __init__(self) -> None:
        self.warned = False
        # the windows after the first: their steps, seconds and seconds spent waiting for data
        self.steps, self.seconds, self.waited = 0, 0.0, 0.0

    def after_step(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        state, timer = trainer.state, trainer.state.timer
        assert timer is not None  # the loop starts it
        timer.add(loss)
        t = trainer.cfg.trainer
        if (
            state.step % t.log_every == 0
            or state.step in (trainer.parts.total_steps, t.stop_at_step)
            or state.stop_requested
            or state.stop_asked
        ):
            timer.pause()
            state.final_loss, wait = self._log(trainer, timer, grad_norm)
            if len(timer.windows) > 1:
                first, last, seconds = timer.windows[-1]
                self.steps += last - first + 1
                self.seconds += seconds
                self.waited += wait * seconds
                share = self.waited / self.seconds if self.seconds else 0.0
                if (
                    not self.warned
                    and share >= DATA_WAIT_WARNED
                    and self.steps >= DATA_WAIT_STEPS
                    and self.seconds >= DATA_WAIT_SECONDS
                ):
                    self.warned = True
                    _say_input_bound(trainer, (timer.windows[1][0], last), share)
            timer.reset()

    @staticmethod
    def _log(trainer: Trainer, timer: StepTimer, grad_norm: torch.Tensor) -> tuple[float, float]:
        """Reduce the window's loss and the grad norm over DP (every rank calls this), log on rank
        0."""
        state, parts, lay = trainer.state, trainer.parts, trainer.layout
        stats = torch.stack(
            [
                timer.loss / timer.steps,
                grad_norm.to(timer.loss),
                torch.tensor(timer.data_wait, device=timer.loss.device),
            ]
        )
        mean_loss, norm, wait = (lay.all_reduce_dp(stats) / lay.dp).tolist()
        sampler = parts.data.train_sampler
        images = sampler.images(state.step - timer.steps, state.step)
        rate = images / max(timer.close_window(state.step), 1e-9)
        lr = state.step_lr  # the LR the window's last step trained with
        mfu = trainer.utilisation.mfu(rate)
        trainer.metrics.log(
            state.step,
            epoch=state.epoch + 1,
            loss=mean_loss,
            lr=lr,
            grad_norm=norm,
            images_per_s=rate,
            data_wait=wait,
            **({"mfu": mfu} if mfu is not None else {}),
        )
        peak = trainer.utilisation.peak_gpu_gib()
        memory = f" | {peak:.1f} GiB peak" if peak is not None else ""
        utilisation = f" | MFU {100 * mfu:.1f}%" if mfu is not None else ""
        # said where the loader holds the step back
        if wait >= DATA_WAIT_SHOWN:
            utilisation += f" | data wait {100 * wait:.0f}%"
        epochs = math.ceil(parts.total_steps / sampler.steps_per_epoch)
        # one decimal (two below 10), every line alike
        rate_text = f"{rate:.1f}" if rate >= 10 else f"{rate:.2f}"
        # a window cut short (the first after a resume, the run's last) averages fewer steps
        first = state.step - timer.steps + 1
        window = (
            ""
            if timer.steps >= int(trainer.cfg.trainer.log_every)
            else f" (steps {first}-{state.step})"
            if timer.steps > 1
            else f" (step {state.step} alone)"
        )
        log.info(
            "step %d/%d | epoch %d/%d | loss %.4f%s | lr %.2e | %s img/s%s%s",
            state.step,
            parts.total_steps,
            state.epoch + 1,
            epochs,
            mean_loss,
            window,
            lr,
            rate_text,
            utilisation,
            memory,
        )
        if state.progress is not None:
            state.progress.update(
                0,
                completed=state.step,
                stats=(
                    f"epoch {state.epoch + 1}/{epochs}  loss {mean_loss:.4f}  lr {lr:.2e}  "
                    f"{rate_text} "
                    f"img/s{utilisation.replace(' | ', '  ')}{memory.replace(' | ', '  ')}"
                ),
            )
        return mean_loss, wait


def _say_input_bound(trainer: Trainer, window: tuple[int, int], wait: float) -> None:
    """One warning (rank 0) that the loader holds the step back, with the settings that feed it."""
    if not trainer.layout.is_main:
        return
    d = trainer.cfg.data
    workers = getattr(getattr(trainer.parts.data, "train_loader", None), "num_workers", None)
    now = (
        f"{workers} loader worker{'s' if workers != 1 else ''} a rank"
        if workers is not None
        else ""
    )
    log.warning(
        "steps %d-%d waited for their input %.0f%% of the time: the loader is behind the step "
        "(%s%s). More workers (data.num_workers; -1: the CPUs allow), %sfaster storage or packed "
        "shards (tools/data.py pack) feed it; docs/performance.md",
        window[0],
        window[1],
        100 * wait,
        now,
        f", data.decode_on={d.get('decode_on', 'auto')}" if d.get("decode_on") else "",
        "data.decode_on=device on a GPU (nvJPEG), " if trainer.layout.device.type == "cuda" else "",
    )


class TimelineHook(Hook):
    """Records one pipeline step's actions on every rank (`parallel.timeline`): the second step of
    this process (the first also sets up the schedule's buffers), or the only one; rank 0 writes
    pipeline_timeline.json / .png and the bubble fraction. Owns `state.bubble`."""

    def __init__(self) -> None:
        self.recording = False

    def step_context(self, trainer: Trainer) -> ContextManager[Any]:
        state, pipe = trainer.state, trainer.parts.pipeline
        start = state.resumed.step
        wanted = start + (2 if trainer.parts.total_steps - start >= 2 else 1)
        self.recording = (
            pipe is not None and run_of(trainer.layout).timeline and state.step + 1 == wanted
        )
        return pipe.timeline() if pipe is not None and self.recording else contextlib.nullcontext()

    def after_step(self, trainer: Trainer, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if self.recording:
            self.recording = False
            with trainer.untimed():
                self._save(trainer)

    @staticmethod
    def _save(trainer: Trainer) -> None:
        lay, p = trainer.layout, trainer.parts.pipeline
        assert p is not None
        if lay.dp_rank or lay.tp_rank:  # one pipeline group (rank 0's) draws the picture
            return
        events: Any = [None] * lay.pp if lay.is_main else None
        dist.gather_object(p.recorder.events, events, dst=0, group=lay.pp_group)
        if not lay.is_main:
            return
        events = [e for rank_events in events for e in rank_events]
        stats = bubble_fraction(events, lay.pp)
        trainer.state.bubble = stats["bubble"]
        title = (
            f"{trainer.cfg.model.name} {p.schedule_name}: pp={lay.pp}, {p.n_stages} stages, "
            f"{p.microbatches} micro-batches"
        )
        (trainer.run_dir / "pipeline_timeline.json").write_text(
            json.dumps(
                {"title": title, "step": trainer.state.step, **stats, "events": to_json(events)},
                indent=1,
            )
        )
        png = plot_timeline(events, trainer.run_dir / "pipeline_timeline.png", title)
        log.info(
            "pipeline step %d: bubble %.1f%% of %.0f ms (per rank: %s); timeline %s",
            trainer.state.step,
            100 * stats["bubble"],
            1e3 * stats["span_s"],
            ", ".join(f"{100 * b:.0f}%" for b in stats["bubble_per_rank"]),
            png,
        )
