"""What a rank's loader workers need of the rank's fault handling, below every other layer (the data
package uses it; `visiondist.faults.health` / `failures` build the rank's side on it): which signals
stop a run, the environment variables naming the run dir and rank, and the worker's stack dump into
the run's hang folder; and how a process takes a stop signal (`StopSignals`: the rank's `STOP`, and
the tools' own while they work in the launching process)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Optional, Union

# the rank's stop lines read as its fault handling's
log = logging.getLogger("visiondist.faults.health")

# a stop at the next step boundary, with a checkpoint
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# the run dir, for the loader workers of this rank (fork or spawn)
RUN_DIR_ENV = "VISIONDIST_RUN_DIR"
RANK_ENV = "VISIONDIST_RANK"
HANG_DIR = "hang"  # <run>/hang/: the stacks written when a rank hangs


def ignore_stop_signals() -> None:
    """In data-loader workers: SIGTERM / SIGINT are for the rank, which stops them itself after its
    checkpoint."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def install_worker_stack_dump() -> None:
    """In a loader worker: SIGUSR1 writes this worker's stack into the rank's hang folder."""
    run_dir, rank = os.environ.get(RUN_DIR_ENV), os.environ.get(RANK_ENV, "0")
    if not run_dir:
        return

    def handler(_signum, frame) -> None:
        path = Path(run_dir) / HANG_DIR / f"rank{rank}-worker{os.getpid()}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"loader worker of rank {rank}, pid "
            f"{os.getpid()}:\n{''.join(traceback.format_stack(frame))}"
        )

    signal.signal(signal.SIGUSR1, handler)


class StopNow(BaseException):
    """Raised in the main thread by a stop signal that cannot wait for a step boundary: an
    evaluation's or an export's first signal (nothing to save), a training run's second one (stop at
    once, without a checkpoint). A BaseException, so that no `except Exception` in a library
    swallows it."""

    def __init__(self, signal_name: str):
        super().__init__(f"stopped by {signal_name}")
        self.signal_name = signal_name


# what `signal.signal` hands back: a function, SIG_DFL / SIG_IGN, or None (not set from Python)
_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, None]


class StopSignals:
    """SIGTERM / SIGINT request a stop at the next step boundary (the previous handlers come back on
    `restore`).

    `at_once`: the job has no step boundary to wait for (evaluation): the first signal raises
    `StopNow`. Otherwise the first signal sets `received` and a second request raises `StopNow` (the
    checkpoint is given up). Signals within `SAME_REQUEST_S` of the first are the same request: a
    terminal's Ctrl-C reaches every process of the job and the launcher forwards it as well.
    `speak`: this process says what happens (one voice per job)."""

    SAME_REQUEST_S = 1.0

    def __init__(self) -> None:
        self.received: str | None = None
        self.count = 0  # stop requests
        self.at_once = False
        self.speak = True
        self._first = 0.0
        self._previous: dict[signal.Signals, _Handler] = {}

    def install(self, at_once: bool = False, speak: bool = True) -> StopSignals:
        """Handle the stop signals from now on; where this is not the main thread (a Ray Train
        worker runs the training function in one of its own), the host's handlers stay: signals
        reach only a main thread."""
        self.received, self.count, self.at_once, self.speak = None, 0, at_once, speak
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received, self.count, self._first = name, 1, time.monotonic()
            if self.at_once:
                raise StopNow(name)
            if self.speak:
                log.warning(
                    "%s received: stopping with a checkpoint after this step or the next, the "
                    "first every rank has heard of it (a second Ctrl-C or SIGTERM stops at once, "
                    "without it)",
                    name,
                )
        elif (
            time.monotonic() - self._first > self.SAME_REQUEST_S
            and self.count == 1
            and not self.at_once
        ):
            self.count = 2
            raise StopNow(name)

    def restore(self, ignore: bool = False) -> None:
        """The previous handlers back; `ignore`: stop signals ignored from now on instead (a rank
        whose launcher handles them: a late one must not end the process before it hands its result
        back)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if ignore else handler)
        self._previous.clear()


STOP = StopSignals()  # the rank's; installed by `visiondist.launch.rank.run_rank`
