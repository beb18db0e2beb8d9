"""A failing job's one line: each rank's record of its own failure (`record_rank_failure`, and the
wait that lets the launcher see a peer's end first), and the launcher's `RunFailed` built from the
records (`one_line_failure`).

The launching process imports this module for every job: the failure records' module (and with it
rich's console: 15 ms) is imported where a failure is recorded or read
(`# noqa: PLC0415 (rich, 15 ms)`)."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from visiondist.config.layout import RunLayout
from visiondist.launch.stop import JobStopped, LauncherStop, stopped_line
from visiondist.plan.fit import is_out_of_memory, out_of_memory_cause
from visiondist.utils.dcp import list_checkpoints
from visiondist.utils.signals import HANG_DIR, RUN_DIR_ENV


def record_rank_failure(
    run_dir: Optional[Path], exc: BaseException, cfg: DictConfig, run: RunLayout
) -> str:
    """This rank's failure record (`visiondist.faults.failures.record_failure`), with the plan's
    cause of an out-of-memory and the stacks of a collective's timeout; the exception carries the
    line for this process's own report. Returns the line."""
    from visiondist.faults.failures import (  # noqa: PLC0415 (rich, 15 ms)
        FAILURE_DIR,
        dump_stacks,
        is_collective_timeout,
        one_line,
        record_failure,
    )

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    cause = ""
    # the plan's figure for this layout and what would fit, not the allocator's essay
    if is_out_of_memory(exc):
        try:
            cause = out_of_memory_cause(cfg, run, exc)
        except Exception:
            cause = ""
    if run_dir is not None and is_collective_timeout(exc):
        try:
            dump_stacks(run_dir, rank, one_line(exc))
            cause = f"{one_line(exc)}; the stacks of every thread are in {run_dir / HANG_DIR}"
        except OSError:
            pass
    line = record_failure(run_dir, rank, exc, cause)
    where = (
        f" (traceback: {run_dir / FAILURE_DIR / f'rank{rank}.txt'})" if run_dir is not None else ""
    )
    # the exception carries its line to this process's own report (`one_line_failure`)
    exc.visiondist_line = line + where  # type: ignore[attr-defined]
    return line


LOST_PEER_WAIT_S = 3.0


def wait_for_the_launcher_after_a_lost_peer(line: str, stop: Any) -> None:
    """A rank that failed only because a peer's connection closed (gloo's ranks fail on it at once)
    waits, up to `LOST_PEER_WAIT_S`, for its launcher to end it. The elastic agent reports one
    rank's end, the first it sees at its 0.1 s poll; a peer that a signal ended (the OOM killer,
    `kill -9`) leaves no record of its own, so only its exit status, seen first, names the cause.
    The wait ends at the launcher's SIGTERM (`stop.received`); a lost peer on another node, which
    this node's launcher cannot see, costs the wait once."""
    from visiondist.faults.failures import is_follow_on  # noqa: PLC0415 (rich, 15 ms)

    if not is_follow_on(line):
        return
    deadline = time.monotonic() + LOST_PEER_WAIT_S
    while stop.received is None and time.monotonic() < deadline:
        time.sleep(0.02)


class RunFailed(Exception):
    """A rank failed. The message is one line: the rank, the step, the cause, and where the
    traceback is.

    Args:
        *args: the line (an exception's message).
    """

    exit_code = 1


@contextmanager
def one_line_failure(run_dir: Optional[Path], stop: Optional[LauncherStop] = None):
    """Turn a rank's exception (this process's, or the elastic launcher's report of a spawned
    rank's) into `RunFailed` with the earliest rank's line from the run dir's failure records; ranks
    that ended while the job was stopping (`stop`) stopped, they did not fail."""
    from visiondist.faults.failures import (  # noqa: PLC0415 (rich, 15 ms)
        first_failure,
        is_follow_on,
        killed_rank,
        one_line,
        rank_errors,
    )

    try:
        yield
    except (JobStopped, RunFailed, SignalException):  # a stop signal is not a failure
        raise
    except ChildFailedError as exc:
        if stop is not None and stop.received is not None and run_dir is not None:
            raise JobStopped(
                stop.received,
                stopped_line(
                    stop.received, run_dir, stop.kind, why=stop.why() if stop.ended else ""
                ),
            ) from None
        found = first_failure(run_dir) if run_dir is not None else None
        killed = killed_rank({rank: f.exitcode for rank, f in exc.failures.items()}, found)
        # no report of its own; what its peers recorded (a lost connection) followed it
        if killed is not None:
            after = (
                f"; rank {found.rank} then lost its connection (traceback: {found.file})"
                if found
                else ""
            )
            raise RunFailed(
                f"rank {killed[0]} ended (killed by {killed[1]}) without a report{after}"
                f"{_continue_hint(run_dir, found.line if found else '')}"
            ) from None
        if found is None:
            rank, failure = exc.get_first_failure()
            why = (
                f"killed by {signal.Signals(-failure.exitcode).name}"
                if failure.exitcode < 0
                else f"exit code {failure.exitcode}"
            )
            raise RunFailed(
                f"rank {rank} ended ({why}) without a report: see the output above"
            ) from None
        raise RunFailed(
            f"{found.line} (traceback: {found.file}){_continue_hint(run_dir, found.line)}"
        ) from None
    # this process's own rank: its line (torchrun: each rank says its own)
    except rank_errors() as exc:
        line = getattr(exc, "visiondist_line", None) or one_line(exc)
        if run_dir is not None:
            raise RunFailed(line + _continue_hint(run_dir, line)) from exc
        # torchrun / srun: this rank's run dir, as it told its loader workers
        where = os.environ.get(RUN_DIR_ENV)
        if is_follow_on(line):  # the cause is the peer's: it ended first, on its own node
            line += (
                "; this rank lost its connection to a rank that ended first: that rank's own "
                "output (its node's, under torchrun) says why"
                + (f", and {where}/failure/ holds what it recorded" if where else "")
            )
        raise RunFailed(
            line + _continue_hint(Path(where) if where else None, line, under_torchrun=True)
        ) from exc


def _continue_hint(run_dir: Optional[Path], line: str, under_torchrun: bool = False) -> str:
    """A training failure after a checkpoint (a data server gone, a node lost, a rank killed while
    it saved the next one): how to continue once it is fixed (`under_torchrun`: the ranks' own
    command again)."""
    phases = ("(training)", "(evaluating)", "(saving a checkpoint)", "(writing the weights)")
    if run_dir is None or not any(phase in line for phase in phases):
        return ""
    # rich comes with it: 15-30 ms of every launch, for a failed job's last line
    from visiondist.observe.console import continue_command  # noqa: PLC0415 (rich, 15 ms)

    kept = list_checkpoints(Path(run_dir))
    if not kept:
        return ""
    return (
        f"; once fixed, continue from step {kept[-1][0]} with: "
        f"{continue_command(run_dir, under_torchrun)}"
    )
