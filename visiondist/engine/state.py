"""What the training loop knows of its run while it runs: one typed `LoopState`, each field written
by one owner (named beside it), read by everyone else: the hooks, the summary and the callbacks of
the Python API. `StepTimer` is the loop's clock of training time.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from visiondist.utils.clock import DeviceClock


class StepTimer:
    """This rank's losses and training seconds since the last log line, and every log window's
    seconds.

    Seconds are the device's (`DeviceClock`: CUDA events, read when the log line's all-reduce has
    the host wait anyway), so that a window's rate is the device's, not the rate at which the host
    queued its steps. Evaluations, checkpoints and the timeline's gathering are not training time
    (`untimed`).

    The host's seconds in the window, and those it spent waiting for the loader's next batch
    (`fed`), give `data_wait`: the share of training time the step waited for its input (timm's
    and detectron2's "data time"). A loader that keeps up leaves it near 0 (its batches are ready);
    where it is high, the devices idle while the loader works.
    """

    def __init__(self, device: torch.device):
        self.loss = torch.zeros((), device=device)
        self.steps = 0
        self.clock = DeviceClock(device)
        # (first step, last step, seconds) of each logged window
        self.windows: list[tuple[int, int, float]] = []
        self._logged_seconds = 0.0
        self.wait_s = 0.0  # host seconds in next(batches) this window
        self._host_s = 0.0  # host seconds of the window's stopped intervals
        self._host_from: Optional[float] = None
        self.start()

    def start(self) -> None:
        self.clock.start()
        self._host_from = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss += loss
        self.steps += 1

    def pause(self) -> None:
        self.clock.stop()
        if self._host_from is not None:
            self._host_s += time.perf_counter() - self._host_from
            self._host_from = None

    def resume(self) -> None:
        self.start()

    def fed(self, batches: Iterator[Any]) -> Iterator[Any]:
        """`batches`, with the host's seconds waiting in each `next()` counted."""
        it = iter(batches)
        while True:
            start = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.wait_s += time.perf_counter() - start
            yield batch

    @property
    def data_wait(self) -> float:
        """The share of this window's host seconds spent waiting for a batch (paused before)."""
        return min(1.0, self.wait_s / self._host_s) if self._host_s > 0 else 0.0

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Work between steps that is not training time: evaluations, checkpoints, the timeline's
        gathering."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def close_window(self, last_step: int) -> float:
        """The seconds of the window that ends with `last_step` (paused before), recorded in
        `windows`."""
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
        self.wait_s = self._host_s = 0.0
        self.start()

    def steady_state(self) -> Optional[tuple[int, int, float]]:
        """(first step, last step, seconds) of the windows after the first (which holds the
        start-up: compilation, cuDNN's autotuning, the loader's first batches), or None with fewer
        than two windows."""
        later = self.windows[1:]
        if not later:
            return None
        return later[0][0], later[-1][1], sum(w[2] for w in later)


@dataclass(frozen=True)
class Resumed:
    """Where this process started: the checkpoint it resumed from (None: step 0) and what that
    checkpoint said."""

    checkpoint: Optional[Path] = None
    step: int = 0
    skipped_steps: int = 0  # optimizer steps skipped before, over every attempt
    overflow_steps: int = 0
    # training seconds of the attempts before this one (None: not counted)
    earlier_seconds: Optional[float] = 0.0

    def same_run(self, run_dir: Path) -> bool:
        """The checkpoint is this run dir's own (a continued run, not a new one started from
        another's weights)."""
        return self.checkpoint is not None and self.checkpoint.parent.parent == Path(run_dir)


LOOPS = ("Trainer", "OursRun")  # the training loop, and the benchmark's loop of its step alone


def _owned(owner: str, default: Any = MISSING, default_factory: Any = MISSING) -> Any:
    """A field of `LoopState` and the one class that writes it."""
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={"owner": owner})
    return field(default=default, metadata={"owner": owner})


@dataclass
class LoopState:
    """The run so far, as the loop and its hooks see it. One owner writes each field (its `owner`:
    the loop `Trainer`, or the benchmark's `OursRun` in its place, the parts it holds, one hook);
    the rest only read it. A new hook that tells others something adds a field it owns.

    Args:
        resumed: where this process started (written before the loop, by resuming).
        step: optimizer steps done.
        epoch: the epoch the next step is in, from 0.
        timer: the loop's clock of training time, from its start.
        stop_requested: a stop signal reached some rank (agreed by all).
        stop_asked_here: a user's callback on this rank asked the run to stop (its name).
        stop_asked: a callback on some rank asked the run to stop (agreed by all).
        save_wanted_here: this rank's clock says a checkpoint is due (rank 0 only:
            `trainer.checkpoint_every_min` since the last one).
        save_due: the latest step whose agreed verdict said a checkpoint is due (0: none).
        skipped_steps: optimizer steps skipped as non-finite, over every attempt.
        overflow_steps: fp16 steps skipped because a scaled gradient overflowed.
        step_lr: the peak learning rate the latest optimizer step used (the schedule has moved on
            by the time the step's hooks run).
        last_eval: the latest evaluation's metrics and "step".
        final_loss: the last logged mean train loss.
        progress: the progress bar (rank 0, `trainer.progress`), or None.
        tp_bytes_per_step: ring bytes one rank sends in TP collectives a step.
        pp_bytes_per_step: bytes one rank sends to its pipeline neighbours a step.
        bubble: a pipeline step's idle fraction, measured once.
        best: this process's best evaluated checkpoint.
        weights: model.safetensors, once a complete run wrote it.
    """

    # each field's owner (`owner`: the class whose code writes it; `owned`), and what it holds
    resumed: Resumed = _owned("resume", default_factory=Resumed)  # before the loop, once
    step: int = _owned("loop", 0)  # optimizer steps done (counted from 1 in the log lines)
    epoch: int = _owned("loop", 0)  # the epoch the next step is in, from 0
    timer: Optional[StepTimer] = _owned("loop", None)  # from the loop's start
    stop_requested: bool = _owned("OptimizerStep", False)  # a stop signal reached some rank
    stop_asked_here: Optional[str] = _owned("CallbackHook", None)  # a callback's name, this rank
    stop_asked: bool = _owned("OptimizerStep", False)  # a callback on some rank asked to stop
    save_wanted_here: bool = _owned("CheckpointHook", False)  # rank 0's clock: a checkpoint due
    save_due: int = _owned("OptimizerStep", 0)  # the latest step whose verdict said one is due
    skipped_steps: int = _owned("OptimizerStep", 0)  # non-finite, over every attempt
    overflow_steps: int = _owned("OptimizerStep", 0)  # fp16: a scaled gradient overflowed
    step_lr: float = _owned("OptimizerStep", 0.0)  # the peak group's LR of the latest step
    last_eval: dict[str, Any] = _owned("Validation", default_factory=dict)  # metrics and "step"
    final_loss: float = _owned("LogHook", math.nan)  # the last logged mean train loss
    progress: Any = _owned("ProgressHook", None)  # the bar (rank 0, `trainer.progress`)
    tp_bytes_per_step: Optional[float] = _owned("TrafficHook", None)  # ring bytes of TP collectives
    pp_bytes_per_step: Optional[int] = _owned("TrafficHook", None)  # bytes to pipeline neighbours
    bubble: Optional[float] = _owned("TimelineHook", None)  # a pipeline step's idle fraction
    best: Optional[dict[str, Any]] = _owned("BestCheckpointHook", None)  # the best evaluated
    weights: Optional[Path] = _owned("WeightsHook", None)  # model.safetensors, of a complete run

    @staticmethod
    def owners(name: str) -> tuple[str, ...]:
        """The classes whose code may write the field `name` (`tests/unit/test_layers.py` checks
        it): the loop's are the `Trainer` and, timing the step alone, the benchmark's `OursRun`."""
        owner = next(f.metadata["owner"] for f in fields(LoopState) if f.name == name)
        return LOOPS if owner == "loop" else (owner,)

    @classmethod
    def starting_from(cls, resumed: Resumed, steps_per_epoch: int) -> LoopState:
        """The state at the start of this process: step 0, or the step of the checkpoint it resumed
        from.

        Args:
            resumed: where this process started (`Resumed()`: step 0).
            steps_per_epoch: global batches an epoch, which places the step in its epoch.

        Returns:
            The state the loop starts from.
        """
        return cls(
            resumed=resumed,
            step=resumed.step,
            epoch=resumed.step // steps_per_epoch,
            skipped_steps=resumed.skipped_steps,
            overflow_steps=resumed.overflow_steps,
        )
