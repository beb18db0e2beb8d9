"""The training loop's periodic and cross-cutting concerns, one class each, each owning its cadence.

`Trainer.fit` runs `before_train`, then for every step the step inside each hook's `step_context` and then
`after_step`, then `after_train` (and `close` in any case), calling the hooks in the order `default_hooks` gives
(detectron2's HookBase, torchtitan's components deciding their own cadence). A hook that sets `trainer.stopping` ends
the loop after the current step: the hooks after it do not see that step (a stopped job logs its last step, but
neither records its timeline nor evaluates it; it checkpoints it in `after_train`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from typing import Any

import torch

from visiondist.faults.health import set_collective_timeout
from visiondist.observe.console import in_terminal
from visiondist.observe.progress import progress_bar
from visiondist.train.hook import Hook
from visiondist.train.results_hooks import (
    BestCheckpointHook,
    CheckpointHook,
    EvalHook,
    WeightsHook,
)

log = logging.getLogger(__name__)


class StepTimer:
    """This rank's losses and training seconds since the last log line, and every log window's seconds. Seconds are
    the device's (`DeviceClock`: CUDA events, read when the log line's all-reduce has the host wait anyway), so that a
    window's rate is the device's, not the rate at which the host queued its steps. Evaluations, checkpoints and the
    timeline's gathering are not training time (`with trainer.untimed()`)."""

    def __init__(self, device: torch.device):
        from visiondist.utils.clock import DeviceClock

        self.loss = torch.zeros((), device=device)
        self.steps = 0
        self.clock = DeviceClock(device)
        self.windows: list[tuple[int, int, float]] = []  # (first step, last step, seconds) of each logged window
        self._logged_seconds = 0.0
        self.clock.start()

    def add(self, loss: torch.Tensor) -> None:
        self.loss += loss
        self.steps += 1

    def pause(self) -> None:
        self.clock.stop()

    def resume(self) -> None:
        self.clock.start()

    def close_window(self, last_step: int) -> float:
        """The seconds of the window that ends with `last_step` (paused before), recorded in `windows`."""
        seconds = self.clock.seconds()
        self.windows.append((last_step - self.steps + 1, last_step, seconds))
        self._logged_seconds += seconds
        return seconds

    @property
    def total_seconds(self) -> float:
        """Training seconds so far: the logged windows and the current one up to its last pause."""
        return self._logged_seconds + self.clock.seconds()

    def reset(self) -> None:
        self.loss.zero_()
        self.steps = 0
        self.clock.reset()
        self.clock.start()

    def steady_state(self) -> tuple[int, int, float] | None:
        """(first step, last step, seconds) of the windows after the first (which holds the start-up: compilation,
        cuDNN's autotuning, the loader's first batches), or None with fewer than two windows."""
        later = self.windows[1:]
        if not later:
            return None
        return later[0][0], later[-1][1], sum(w[2] for w in later)


class ProgressHook(Hook):
    """The rich progress bar on the main rank (`trainer.progress`), in a terminal: into a pipe or a file a bar is one
    cut-off line at the end, and the log lines already say how far the run is; there, this process's first step gets
    a line of its own when it has no log line (`trainer.log_every` apart, the first can be minutes away) and no
    compile line (`CompileHook`)."""

    def __init__(self):
        self.started: float | None = None  # when training began, until the first step's line

    def before_train(self, trainer):
        t = trainer.cfg.trainer
        shown = t.progress and trainer.layout.is_main and in_terminal()
        trainer.progress = progress_bar(shown, trainer.total_steps)
        quiet = not shown and trainer.layout.is_main and t.log_every > 1 and not trainer.layout.run.compile
        self.started = time.perf_counter() if quiet else None

    def after_step(self, trainer, loss, grad_norm):
        if trainer.progress is not None:
            trainer.progress.update(0, completed=trainer.step)
        if self.started is not None:
            t = trainer.cfg.trainer
            if trainer.step % t.log_every and trainer.step not in (trainer.total_steps, t.stop_at_step):
                log.info("training: step %d/%d done after %.1f s (the first batches included); a line every %d "
                         "steps (trainer.log_every)", trainer.step, trainer.total_steps,
                         time.perf_counter() - self.started, t.log_every)
            self.started = None

    def close(self, trainer):
        if trainer.progress is not None:
            trainer.progress.stop()


class TimeoutHook(Hook):
    """After the first step of this process (start-up, compilation and first collectives are over), collectives time
    out after `trainer.dist_timeout_s`: a hang fails fast. Said on the console where there are ranks to wait for
    (one rank's collectives wait on nobody)."""

    def after_step(self, trainer, loss, grad_norm):
        if trainer.step == trainer.resumed_from_step + 1:
            set_collective_timeout(trainer.cfg.trainer.dist_timeout_s, trainer.groups(),
                                   quiet=trainer.layout.world_size == 1)


class StopHook(Hook):
    """A stop signal on any rank (the step's all-reduced flags) ends the loop after this step."""

    def after_step(self, trainer, loss, grad_norm):
        if trainer.stop_requested and trainer.step < trainer.total_steps:
            trainer.stopping = True


class TrafficHook(Hook):
    """Bytes one step moves through TP collectives and pipeline sends, noted once (every step moves the same). A
    pipeline's first step also runs the schedule's shape inference, so its second step is counted."""

    def __init__(self):
        self.noted = False

    def before_train(self, trainer):
        trainer.reset_traffic()

    def after_step(self, trainer, loss, grad_norm):
        if self.noted:
            return
        comm, pipe = trainer.layout.tp_comm, trainer.pipeline
        if pipe is not None and trainer.step == trainer.resumed_from_step + 1:
            trainer.reset_traffic()
            return
        self.noted = True
        if comm is not None:
            trainer.tp_bytes_per_step = comm.ring_bytes()
            calls = ", ".join(f"{n} {kind}" for kind, n in sorted(comm.calls.items()))
            log.info("tensor parallel traffic: %.2f MB sent per rank per step (%s)", trainer.tp_bytes_per_step / 1e6,
                     calls)
        if pipe is not None:
            trainer.pp_bytes_per_step = pipe.p2p.bytes
            log.info("pipeline traffic: %.2f MB sent per rank per step (%d sends to neighbouring stages)",
                     pipe.p2p.bytes / 1e6, pipe.p2p.sends)


class LogHook(Hook):
    """Every `trainer.log_every` steps, at the last and at a stop (signal or `trainer.stop_at_step`): the mean loss
    over DP, grad norm, LR and images/s to the metrics (CSV, TensorBoard), the console and the progress bar."""

    def before_train(self, trainer):
        trainer.timer = StepTimer(trainer.layout.device)

    def after_step(self, trainer, loss, grad_norm):
        timer = trainer.timer
        timer.add(loss)
        t = trainer.cfg.trainer
        if (trainer.step % t.log_every == 0 or trainer.step in (trainer.total_steps, t.stop_at_step)
                or trainer.stop_requested):
            timer.pause()
            trainer.final_loss = self._log(trainer, timer, grad_norm)
            timer.reset()

    @staticmethod
    def _log(trainer, timer: StepTimer, grad_norm: torch.Tensor) -> float:
        """Reduce the window's loss and the grad norm over DP (every rank calls this), log on rank 0."""
        stats = torch.stack([timer.loss / timer.steps, grad_norm.to(timer.loss)])
        mean_loss, norm = (trainer.layout.all_reduce_dp(stats) / trainer.layout.dp).tolist()
        steps = timer.steps
        images = trainer.data.train_sampler.images(trainer.step - steps, trainer.step)
        rate = images / max(timer.close_window(trainer.step), 1e-9)
        lr = trainer.optimizer.param_groups[0]["lr"]
        mfu = trainer.mfu(rate)
        trainer.metrics.log(trainer.step, epoch=trainer.epoch + 1, loss=mean_loss, lr=lr, grad_norm=norm,
                            images_per_s=rate,
                            **({"mfu": mfu} if mfu is not None else {}))
        peak = trainer.peak_gpu_gib()
        memory = f" | {peak:.1f} GiB peak" if peak is not None else ""
        utilisation = f" | MFU {100 * mfu:.1f}%" if mfu is not None else ""
        epochs = math.ceil(trainer.total_steps / trainer.data.train_sampler.steps_per_epoch)
        rate_text = f"{rate:.1f}" if rate >= 10 else f"{rate:.2f}"  # one decimal (two below 10), every line alike
        log.info("step %d/%d | epoch %d/%d | loss %.4f | lr %.2e | %s img/s%s%s", trainer.step, trainer.total_steps,
                 trainer.epoch + 1, epochs, mean_loss, lr, rate_text, utilisation, memory)
        if trainer.progress is not None:
            trainer.progress.update(0, completed=trainer.step, stats=(
                f"epoch {trainer.epoch + 1}/{epochs}  loss {mean_loss:.4f}  lr {lr:.2e}  {rate_text} img/s"
                f"{utilisation.replace(' | ', '  ')}{memory.replace(' | ', '  ')}"))
        return mean_loss


class TimelineHook(Hook):
    """Records one pipeline step's actions on every rank (`parallel.timeline`): the second step of this process (the
    first also sets up the schedule's buffers), or the only one; rank 0 writes pipeline_timeline.json / .png and the
    bubble fraction."""

    def __init__(self):
        self.recording = False

    def step_context(self, trainer):
        start, pipe = trainer.resumed_from_step, trainer.pipeline
        wanted = start + (2 if trainer.total_steps - start >= 2 else 1)
        self.recording = pipe is not None and trainer.layout.run.timeline and trainer.step + 1 == wanted
        return pipe.timeline() if self.recording else contextlib.nullcontext()

    def after_step(self, trainer, loss, grad_norm):
        if self.recording:
            self.recording = False
            with trainer.untimed():
                self._save(trainer)

    @staticmethod
    def _save(trainer) -> None:
        import torch.distributed as dist

        from visiondist.parallel.timeline import bubble_fraction, plot_timeline, to_json

        lay, p = trainer.layout, trainer.pipeline
        if lay.dp_rank or lay.tp_rank:  # one pipeline group (rank 0's) draws the picture
            return
        events: Any = [None] * lay.pp if lay.is_main else None
        dist.gather_object(p.recorder.events, events, dst=0, group=lay.pp_group)
        if not lay.is_main:
            return
        events = [e for rank_events in events for e in rank_events]
        stats = bubble_fraction(events, lay.pp)
        trainer.bubble = stats["bubble"]
        title = (f"{trainer.cfg.model.name} {p.schedule_name}: pp={lay.pp}, {p.n_stages} stages, "
                 f"{p.microbatches} micro-batches")
        (trainer.run_dir / "pipeline_timeline.json").write_text(
            json.dumps({"title": title, "step": trainer.step, **stats, "events": to_json(events)}, indent=1))
        png = plot_timeline(events, trainer.run_dir / "pipeline_timeline.png", title)
        log.info("pipeline step %d: bubble %.1f%% of %.0f ms (per rank: %s); timeline %s", trainer.step,
                 100 * stats["bubble"], 1e3 * stats["span_s"],
                 ", ".join(f"{100 * b:.0f}%" for b in stats["bubble_per_rank"]), png)


def default_hooks() -> list[Hook]:
    """In this order, for a reason each:
    - progress first, so the bar shows the step even if a later hook fails on it;
    - the collective timeout right after the first step, before anything else can hang on a collective;
    - traffic and the log line next: they describe the step just run (a stopped job's last step too: metrics.csv
      has every step the checkpoint holds);
    - the stop check before the rest of the per-step work, so a stopped job spends nothing more than its checkpoint;
    - the timeline after them: its gathering is not training time;
    - the checkpoint before the evaluation, and (at the end) the weights between them: a failing evaluation loses
      neither the checkpoint nor the weights;
    - the best checkpoint after the evaluation it is chosen by;
    - the compile timer last: it times the first step alone.
    """
    from visiondist.train.compiled import CompileHook

    return [ProgressHook(), TimeoutHook(), TrafficHook(), LogHook(), StopHook(), TimelineHook(), CheckpointHook(),
            WeightsHook(), EvalHook(), BestCheckpointHook(), CompileHook()]
