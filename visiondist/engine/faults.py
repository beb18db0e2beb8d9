"""What a rank does when something goes wrong mid-run: signals, non-finite steps, hung collectives.

- `StopSignals`: SIGTERM / SIGINT set a flag instead of killing the rank. The training loop reads it once per step
  (in the same all-reduce as the step's health), so every rank stops after the same step, writes one checkpoint,
  and leaves; `trainer.resume=auto` continues from it.
- `StepHealth`: one all-reduce per step of [per-rank "loss not finite" flags, "gradient not finite", stop]. Every
  rank then takes the same decision: raise (naming the ranks) or skip the optimizer step (`trainer.on_nonfinite`).
- `set_collective_timeout`: the start-up timeout (long: data generation, compilation) is replaced after the first
  step by `trainer.dist_timeout_s`, so a rank that never joins a collective turns into an error on the others.
"""

from __future__ import annotations

import logging
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class NonFiniteStep(RuntimeError):
    """A step whose loss or gradient is not finite, with `trainer.on_nonfinite=raise`."""


class StopSignals:
    """SIGTERM / SIGINT request a stop at the next step boundary (the previous handlers come back on `restore`)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous = {}

    def install(self) -> "StopSignals":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        if self.received is None:
            log.warning("%s received: stopping after this step with a checkpoint", signal.Signals(signum).name)
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


STOP = StopSignals()  # the rank's; installed by `visiondist.launch.run_rank`


class StepHealth:
    """The step's shared decision: which ranks' losses are not finite, whether the gradient is, whether any rank was
    asked to stop."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size = world_size
        self.flags = torch.zeros(world_size + 2, device=device)

    def check(self, rank: int, loss: torch.Tensor, grad_norm: torch.Tensor, stop: bool) -> tuple[list[int], bool, bool]:
        """Returns (ranks whose loss was not finite, gradient not finite anywhere, stop asked anywhere). Collective."""
        self.flags.zero_()
        self.flags[rank] = (~torch.isfinite(loss.detach().float()).all()).float().to(self.flags.device)
        self.flags[-2] = (~torch.isfinite(grad_norm.detach().float()).all()).float().to(self.flags.device)
        self.flags[-1] = float(stop)
        if self.world_size > 1:
            dist.all_reduce(self.flags)
        values = self.flags.tolist()
        return [r for r in range(self.world_size) if values[r] > 0], values[-2] > 0, values[-1] > 0


def set_collective_timeout(seconds: float, groups) -> None:
    """Every later collective on the default group and on `groups` fails after `seconds` instead of waiting."""
    timeout = timedelta(seconds=seconds)
    dist.set_timeout(timeout)
    for group in groups:
        if group is not None and group != dist.GroupMember.WORLD:
            dist.set_timeout(timeout, group)
    log.info("collective timeout now %gs (trainer.dist_timeout_s)", seconds)


def ignore_stop_signals() -> None:
    """In data-loader workers: SIGTERM / SIGINT are for the rank, which stops them itself after its checkpoint."""
    for sig in StopSignals.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
