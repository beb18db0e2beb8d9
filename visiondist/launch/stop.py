"""Stopping a job with SIGTERM or Ctrl-C without losing it: the launching process's side.

Left to itself, torch's elastic agent turns SIGTERM / SIGINT into "signal every rank, wait 30 s,
SIGKILL", and while it waits the ranks cannot hand their results back: a step or a checkpoint longer
than 30 s was lost, and Ctrl-C took 30 s to return the prompt. A self-launched job handles the two
signals here instead (the agent keeps SIGHUP and SIGQUIT, `compat.agent_signals`):

- the first signal is forwarded to every rank, which finishes its step, writes a checkpoint and
  returns; the agent collects the results as for a finished job, so the prompt returns as soon as
  the checkpoint is on disk;
- after `trainer.stop_timeout_s` (`grace_seconds`: by default 300 s plus the checkpoint's planned
  size at 50 MB/s), or at a second signal, the ranks are ended at once through the agent (SIGKILL,
  no restart);
- the last line (`JobStopped`) comes from what the run dir holds, not from what the ranks meant to
  do: the command that continues the run when a checkpoint of the stopping step is complete;
  otherwise the step since which nothing was saved.

A job that has no step to finish (evaluation) asks its ranks to stop at once
(`visiondist.utils.signals.StopSignals.at_once`).
"""

from __future__ import annotations

import _thread
import csv
import multiprocessing
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from torch.distributed.elastic.multiprocessing.api import SignalException

from visiondist.plan.resolve import layout_memory
from visiondist.utils.dcp import list_checkpoints
from visiondist.utils.signals import STOP_SIGNALS

# the wait for the step in flight and the save, before the checkpoint's own size
AUTO_GRACE_S = 300.0
WRITE_BYTES_PER_S = 50e6  # a slow shared file system


class JobStopped(Exception):
    """The job was asked to stop (SIGTERM / SIGINT). Its message is the job's last line: what was
    kept and how to go on. Exit code 128 + the signal.

    Args:
        signal_name: the signal that stopped it ("SIGTERM", "SIGINT").
        line: the job's last line ("" on a rank that does not speak).
    """

    def __init__(self, signal_name: str, line: str):
        super().__init__(line)
        self.signal_name = signal_name

    @property
    def exit_code(self) -> int:
        return 128 + int(getattr(signal, self.signal_name))


def grace_seconds(cfg: Any, run: Any) -> float:
    """`trainer.stop_timeout_s`, or (-1) 300 s plus the time to write this node's share of the
    checkpoint at 50 MB/s (`write_seconds`)."""
    value = float(cfg.trainer.get("stop_timeout_s", -1))
    if value >= 0:
        return value
    return AUTO_GRACE_S + write_seconds(cfg, run)


def state_bytes(cfg: Any, run: Any) -> float:
    """A rank's training state (weights, optimizer, EMA) by the planner on the layout `run`; 0
    where the planner has no figure (a detector)."""
    try:
        return float(layout_memory(cfg, run).state)
    except Exception:
        return 0.0


def write_seconds(cfg: Any, run: Any) -> float:
    """The planned time to write a node's share of a checkpoint at `WRITE_BYTES_PER_S`: a rank's
    training state (`state_bytes`) times the node's ranks, over the copies data parallelism keeps
    of it (torch.distributed.checkpoint writes a replicated tensor once, from one of its ranks); 0
    where the planner has no figure."""
    # DDP: dp copies; FSDP: one, or dp / shard_size under HSDP
    copies = run.dp // (run.shard_size or run.dp) if run.fsdp else run.dp
    return state_bytes(cfg, run) * run.per_node / max(1, copies) / WRITE_BYTES_PER_S


class LauncherStop:
    """While the agent runs the ranks: SIGTERM / SIGINT forwarded to them once, then a bounded wait
    (module doc)."""

    def __init__(
        self,
        grace_s: float,
        what: str = "the ranks finish their step and write a checkpoint",
        kind: Optional[str] = None,
    ):
        # kind: the entry's run_kind (None: training)
        self.grace_s, self.what, self.kind = grace_s, what, kind
        self.received: Optional[str] = None
        # why the ranks were ended before they finished: "timeout" | "again"
        self.ended: Optional[str] = None
        self._expired = False
        self._previous: dict = {}
        self._timer: Optional[threading.Timer] = None

    def __enter__(self) -> LauncherStop:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            # Ctrl-C in a terminal reached them already; SIGTERM to this process did not
            for pid in _rank_pids():
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
            print(
                f"{self.received}: {self.what} (at most {self.grace_s:.0f} s, "
                "trainer.stop_timeout_s; a second Ctrl-C or SIGTERM ends them at once)",
                file=sys.stderr,
                flush=True,
            )
            self._timer = threading.Timer(self.grace_s, self._expire)
            self._timer.daemon = True
            self._timer.start()
            return
        # the wait is over, or a second signal: the agent kills the ranks (its shutdown, with no
        # restart)
        self.ended = "timeout" if self._expired else "again"
        raise SignalException(f"stopped by {self.received}", sigval=signal.SIGKILL)

    def _expire(self) -> None:
        """The timer's: the ranks had `grace_s`; the main thread ends them (through this class's
        handler)."""
        self._expired = True
        _thread.interrupt_main(signal.SIGTERM)

    def why(self) -> str:
        """Why the ranks were ended, for the last line."""
        if self.ended == "timeout":
            return (
                f"the ranks had not finished within trainer.stop_timeout_s={self.grace_s:g} s and "
                "were ended: raise it"
            )
        return "a second stop signal ended the ranks at once"


def _rank_pids() -> list[int]:
    """The rank processes the agent started: this process's multiprocessing children (the loader
    workers are theirs, and they stop with their rank)."""
    return [p.pid for p in multiprocessing.active_children() if p.pid is not None]


def stopped_line(
    signal_name: str,
    run_dir: str | Path,
    kind: Optional[str],
    result: Any = None,
    under_torchrun: bool = False,
    why: str = "",
) -> str:
    """The job's last line after a stop signal, from what `run_dir` holds (module doc). `result`:
    rank 0's return (the step it stopped after), absent when the ranks were ended, then the last
    step metrics.csv logged stands in; `why`: why the ranks were ended."""
    if kind == "benchmark":
        return f"benchmark stopped by {signal_name}: nothing recorded"
    if kind == "eval":
        return (
            f"evaluation stopped by {signal_name}: nothing evaluated; "
            f"{_clear_unfinished(Path(run_dir))}"
        )
    if kind == "predict":
        return (
            f"prediction stopped by {signal_name}: what its ranks predicted is kept in "
            f"{run_dir}/parts; the same command continues it"
        )
    if kind is not None:
        return f"{kind} stopped by {signal_name}: nothing written"
    kept = list_checkpoints(Path(run_dir))
    newest = kept[-1][0] if kept else None
    # rich comes with it: 15-30 ms of every launch, for a stopped job's last line
    from visiondist.observe.console import continue_command  # noqa: PLC0415 (rich, 15 ms)

    command = continue_command(run_dir, under_torchrun)
    step = (
        result.get("stopped at step")
        if isinstance(result, dict)
        else _last_logged_step(Path(run_dir))
    )
    if newest is not None and step is not None and newest >= step:
        return (
            f"stopped by {signal_name} after step {step} with a checkpoint; continue with: "
            f"{command}"
        )
    why = why or "the ranks ended before their checkpoint"
    if newest is None:
        return (
            f"stopped by {signal_name}: nothing was saved ({why}; no complete checkpoint in "
            f"{run_dir}); {command} starts the run again from step 0"
        )
    return (
        f"stopped by {signal_name}: nothing was saved since step {newest} ({why}); continue from "
        f"step {newest} with: {command}"
    )


# what an evaluation's directory holds before its result: the job's own start-up files
EVAL_START_FILES = {"config.yaml", "eval.log", "layout.json", "plan.json", "plan.txt"}


def _clear_unfinished(run_dir: Path) -> str:
    """A stopped evaluation's directory: removed when it holds only the job's start-up files (no
    eval.json); else left, naming what is in it."""
    try:
        names = sorted(p.name for p in run_dir.iterdir())
    except OSError:
        return "no directory was left"
    if "eval.json" not in names and set(names) <= EVAL_START_FILES:
        shutil.rmtree(run_dir, ignore_errors=True)
        return f"its directory {run_dir} (config.yaml and the log only) was removed"
    return f"{run_dir} holds {', '.join(names)}"


def _last_logged_step(run_dir: Path) -> Optional[int]:
    """The last training step metrics.csv holds (every step a stop ends on is logged), or None."""
    try:
        with (run_dir / "metrics.csv").open() as f:
            steps = [
                row["step"] for row in csv.DictReader(f) if row.get("step") and row.get("loss")
            ]
    except (OSError, KeyError):
        return None
    return int(float(steps[-1])) if steps else None
