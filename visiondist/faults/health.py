"""What a rank does when something goes wrong mid-run: signals, non-finite steps, hung collectives.

- `StopSignals` (`visiondist.utils.signals`, shared with the loader workers): SIGTERM / SIGINT set a
  flag instead of killing the rank. The training loop reads it once per step (in the same all-reduce
  as the step's health), so every rank stops after the same step, writes one checkpoint, and leaves;
  `trainer.resume=auto` continues from it. A second signal, or the first one in a job without steps
  to finish (evaluation), raises `StopNow` at once. The launching process's side (forwarding, the
  bound on the wait, the final line) is `visiondist.launch.stop`.
- `StepHealth`: one all-reduce per step of [per-rank "loss not finite" flags, "gradient not finite",
  stop, a callback's stop, a checkpoint due by rank 0's clock]. Every rank then takes the same
  decision: raise (naming the ranks) or skip the optimizer step (`trainer.on_nonfinite`). With
  `raise` the host reads a step's flags one step later, so the loop never waits for the device;
  `skip` must decide before the optimizer step and reads them at once. fp16's loss scaler skips a
  step on the device, on the same all-reduced flags (`nonfinite`).
- `set_collective_timeout`: the start-up timeout (long: data generation, compilation) is replaced
  after the first step by `trainer.dist_timeout_s`, so a rank that never joins a collective turns
  into an error on the others.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from visiondist.compat import set_pg_timeout
from visiondist.utils.heartbeat import PROGRESS

log = logging.getLogger(__name__)
# after the per-rank loss flags: the gradient's, a stop signal's, a callback's, a checkpoint due
FLAGS = 4


class NonFiniteStep(RuntimeError):
    """A step whose loss or gradient is not finite, with `trainer.on_nonfinite=raise`."""


@dataclass(frozen=True)
class Verdict:
    """The all-reduced health of one step."""

    step: int
    bad_loss_ranks: list[int]  # ranks whose loss was not finite
    bad_grad: bool  # the global gradient norm was not finite
    stop: bool  # some rank was asked to stop (a signal)
    asked: bool = False  # a user's callback on some rank asked the run to stop
    save: bool = False  # a checkpoint is due (`trainer.checkpoint_every_min`, rank 0's clock)

    @property
    def finite(self) -> bool:
        return not self.bad_loss_ranks and not self.bad_grad


class StepHealth:
    """The step's shared decision: which ranks' losses are not finite, whether the gradient is,
    whether any rank was asked to stop, whether a checkpoint is due.

    `submit` starts the all-reduce of a step's flags and a non-blocking copy to the host; `verdict`
    waits for the oldest submitted step's result. Reading a step's verdict after the next step has
    been queued keeps the host from waiting on the device in the hot loop (one step of lag); reading
    it at once (`submit` then `verdict`) is a synchronous check, which skipping a bad step needs."""

    def __init__(self, world_size: int, device: torch.device):
        self.world_size, self.device = world_size, device
        self._pending: list[tuple[int, torch.Tensor, Any]] = []
        # [a flag per rank's loss, the gradient's, a stop signal's, a callback's stop request, a
        # checkpoint due]
        self._last = torch.zeros(world_size + FLAGS, device=device)

    def submit(
        self,
        step: int,
        rank: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        stop: bool,
        asked: bool = False,
        save: bool = False,
    ) -> None:
        """Collective: every rank submits every step. `stop`: a stop signal reached this rank;
        `asked`: a callback on this rank asked the run to stop; `save`: this rank's clock says a
        checkpoint is due."""
        # element copies and fills: no host sync
        flags = torch.zeros(self.world_size + FLAGS, device=self.device)
        flags[rank] = (~torch.isfinite(loss.detach().float()).all()).float()
        flags[-4] = (~torch.isfinite(grad_norm.detach().float()).all()).float()
        # not `flags[-1] = x`: that copies a host scalar, which synchronises
        flags[-3:-2].fill_(float(stop))
        flags[-2:-1].fill_(float(asked))
        flags[-1:].fill_(float(save))
        if self.world_size > 1:
            dist.all_reduce(flags)
        self._last = flags  # on the device, for `nonfinite`
        event = None
        if flags.is_cuda:
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flags = host
        self._pending.append((step, flags, event))

    def nonfinite(self) -> torch.Tensor:
        """The last submitted step's verdict left on the device: a 0-dim tensor, 1.0 when some
        rank's loss or the gradient was not finite, else 0.0, the same on every rank. For a decision
        the device takes without the host waiting for it (fp16's skipped step:
        `visiondist.engine.precision.LossScaler.agree`)."""
        return (self._last[: self.world_size + 1].sum() > 0).float()

    @property
    def pending(self) -> int:
        """Steps submitted whose verdict has not been read."""
        return len(self._pending)

    def verdict(self) -> Verdict | None:
        """The oldest submitted step's verdict (waits for it); None when none is pending."""
        if not self._pending:
            return None
        step, flags, event = self._pending.pop(0)
        if event is not None:
            event.synchronize()
        values = flags.tolist()
        ranks = [r for r in range(self.world_size) if values[r] > 0]
        return Verdict(
            step, ranks, values[-4] > 0, values[-3] > 0, values[-2] > 0, save=values[-1] > 0
        )


def set_collective_timeout(
    seconds: float, groups, quiet: bool = False, key: str = "trainer.dist_timeout_s"
) -> None:
    """Every later collective on the default group and on `groups` fails after `seconds` instead of
    waiting; the hang watchdog's limit follows."""
    timeout = timedelta(seconds=seconds)
    PROGRESS.limit_s, PROGRESS.limit_key = seconds, key  # the watchdog's limit too,
    PROGRESS.at()  # counted from now (a slow first step is not a hang of the new limit's length)
    set_pg_timeout(timeout)
    for group in groups:
        if group is not None and group != dist.GroupMember.WORLD:
            set_pg_timeout(timeout, group)
    if not quiet:
        log.info("collective timeout now %gs (trainer.dist_timeout_s)", seconds)
