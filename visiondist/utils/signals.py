"""What a rank's loader workers need of the rank's fault handling, below every other layer (the data package uses
it; `visiondist.engine.faults` / `failures` build the rank's side on it): which signals stop a run, the environment
variables naming the run dir and rank, and the worker's stack dump into the run's hang folder."""

from __future__ import annotations

import os
import signal
import traceback
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a stop at the next step boundary, with a checkpoint
RUN_DIR_ENV = "VISIONDIST_RUN_DIR"  # the run dir, for the loader workers of this rank (fork or spawn)
RANK_ENV = "VISIONDIST_RANK"
HANG_DIR = "hang"  # <run>/hang/: the stacks written when a rank hangs


def ignore_stop_signals() -> None:
    """In data-loader workers: SIGTERM / SIGINT are for the rank, which stops them itself after its checkpoint."""
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
        path.write_text(f"loader worker of rank {rank}, pid {os.getpid()}:\n{''.join(traceback.format_stack(frame))}")

    signal.signal(signal.SIGUSR1, handler)
