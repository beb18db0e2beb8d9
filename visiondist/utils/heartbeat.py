"""The rank's heartbeat: what it is doing (phase and optimizer step), set by the trainer, evaluation
and checkpoint code. The hang watchdog (`visiondist.faults.failures.Watchdog`) ends a rank whose
heartbeat stops; a failure line says where the rank was (`PROGRESS.where`). Here, below every layer,
so that whatever does long work can beat."""

from __future__ import annotations

import time
from typing import Optional


class Progress:
    """This rank's phase ("starting", "training", "evaluating", "saving a checkpoint", ...) and
    optimizer step."""

    def __init__(self, limit_s: float = 1800.0) -> None:
        self.reset(limit_s)

    def reset(self, limit_s: float) -> None:
        """A rank starts: nothing done yet; the watchdog's limit is `trainer.startup_timeout_s`
        (after the first step: `trainer.dist_timeout_s`)."""
        self.phase, self.step = "starting", 0
        self.beat = time.monotonic()
        self.limit_s, self.limit_key = limit_s, "trainer.startup_timeout_s"

    def at(self, phase: Optional[str] = None, step: Optional[int] = None) -> None:
        """Something progressed: record where, and feed the watchdog."""
        if phase is not None:
            self.phase = phase
        if step is not None:
            self.step = step
        self.beat = time.monotonic()

    @property
    def where(self) -> str:
        return f"step {self.step} ({self.phase})"


PROGRESS = Progress()
