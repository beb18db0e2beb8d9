"""How a failing rank ends the job: one line naming the rank, the step and the cause, and nothing
left running.

- `PROGRESS` (`visiondist.utils.heartbeat`): what this rank is doing (phase and step), set by the
  trainer. It is the watchdog's heartbeat and the "where" of a failure line.
- `record_failure`: a rank that raises writes `<run>/failure/rank<k>.txt` (its one line, the time,
  the full traceback) before it leaves. The launching process reads the earliest of them
  (`first_failure`) and prints its line, so the user sees the cause, not the peers' follow-on errors
  ("connection closed by peer").
- `Watchdog`: a thread per rank. When nothing progresses for the collective timeout
  (`trainer.startup_timeout_s` until the first step ends, `trainer.dist_timeout_s` after), it writes
  the Python stacks of every thread of the rank to `<run>/hang/rank<k>.txt`, asks the rank's loader
  workers for theirs (`rank<k>-worker<pid>.txt`), records the failure and ends the rank. A rank
  stuck inside a C call (a collective, a queue) cannot be interrupted otherwise.
- `dump_stacks`: the same stack file, also written when a collective times out with an error.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

from visiondist.observe import console as run_logging
from visiondist.utils.heartbeat import PROGRESS
from visiondist.utils.signals import HANG_DIR

log = logging.getLogger(__name__)

FAILURE_DIR = "failure"
# under it: the records of failures an automatic restart recovered from, once the run completed
RECOVERED_DIR = "recovered"
EXIT_HANG = 3  # exit code of a rank ended by its watchdog
# this process's start (about): a record older than it is an earlier attempt's
_STARTED = time.time()


def rank_errors() -> tuple[type[BaseException], ...]:
    """What a failing rank can raise, for an `except` clause (evaluated once something was raised):
    torch.distributed.checkpoint's exception derives from BaseException, and can only have been
    raised where that module was imported (the launcher itself never imports it: DTensor comes with
    it, about 0.8 s)."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return (Exception,) if api is None else (Exception, api.CheckpointException)


def one_line(exc: BaseException) -> str:
    """`Type: message` in one line. An exception re-raised from a loader worker carries the worker's
    traceback in its message: its last line is the cause."""
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("Caught ") and "worker process" in lines[0]:
        return f"{lines[-1]} (in a data loader worker)"
    head = lines[0] if lines else ""
    return f"{type(exc).__name__}: {head}" if head else type(exc).__name__


@dataclass
class Failure:
    rank: int
    line: str  # "rank 1 failed at step 2 (training): NonFiniteStep: ..."
    time: float
    file: Path


def record_failure(
    run_dir: Optional[Path], rank: int, exc: Optional[BaseException], cause: str = ""
) -> str:
    """Write this rank's failure record `<run>/failure/rank<k>.txt` (its line, the time, the
    traceback) unless this attempt wrote one (the first cause wins; an earlier attempt's, which a
    restart recovered from, is replaced), and return the line."""
    if not cause and exc is not None:
        cause = one_line(exc)
    line = f"rank {rank} failed at {PROGRESS.where}: {cause}"
    if run_dir is None:
        return line
    path = Path(run_dir) / FAILURE_DIR / f"rank{rank}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.stat().st_mtime < _STARTED:
            text = "".join(traceback.format_exception(exc)) if exc is not None else ""
            now = datetime.now().isoformat(timespec="microseconds")
            tmp = path.with_suffix(".tmp")
            tmp.write_text(f"{line}\n{now}\n{text}")
            tmp.replace(path)
            if rank == 0:  # the run's log ends with the cause too, not mid-way
                with (Path(run_dir) / run_logging.LOG_FILE).open("a") as log_file:
                    log_file.write(f"{now.replace('T', ' ')} ERROR {line}\n{text}")
    except OSError:  # a read-only or full run dir must not hide the failure itself
        pass
    return line


def read_failures(run_dir: Path) -> list[Failure]:
    """Every rank's record, earliest first."""
    found = []
    for path in (Path(run_dir) / FAILURE_DIR).glob("rank*.txt"):
        try:
            line, when = path.read_text().split("\n")[:2]
            found.append(
                Failure(int(path.stem[4:]), line, datetime.fromisoformat(when).timestamp(), path)
            )
        except (OSError, ValueError):
            continue
    return sorted(found, key=lambda f: f.time)


def set_aside_recovered(run_dir: Path) -> list[Failure]:
    """A complete run's failure records, each a failure an automatic restart recovered from, moved
    into `failure/recovered/` (earliest first), so that `failure/` holds only what ended a run (a
    monitor watching it sees no failure where the run went on)."""
    found = read_failures(run_dir)
    if not found:
        return []
    recovered = Path(run_dir) / FAILURE_DIR / RECOVERED_DIR
    recovered.mkdir(exist_ok=True)
    moved = []
    for failure in found:
        target = recovered / failure.file.name
        if target.exists():  # an earlier completion's record of the same rank: both kept
            target = recovered / f"{failure.file.stem}-{int(failure.time)}.txt"
        failure.file.replace(target)
        moved.append(Failure(failure.rank, failure.line, failure.time, target))
    return moved


def first_failure(run_dir: Path) -> Optional[Failure]:
    """The root cause: the earliest record, but a peer's lost connection only if nothing else was
    recorded."""
    found = read_failures(run_dir)
    primary = [f for f in found if not is_follow_on(f.line)]
    return (primary or found)[0] if found else None


def killed_rank(
    exit_codes: dict[int, int], recorded: Optional[Failure]
) -> Optional[tuple[int, str]]:
    """(rank, signal name) of the lowest rank a signal ended (exit code -N: the OOM killer, a `kill
    -9`), which left no record, when that is the root cause: nothing was recorded, or only what
    followed it (`recorded`, the first record, a peer's lost connection: gloo's peers fail on the
    closed socket at once and record that)."""
    if recorded is not None and not is_follow_on(recorded.line):
        return None
    for rank, code in sorted(exit_codes.items()):
        if code < 0 and (recorded is None or rank != recorded.rank):
            return rank, signal.Signals(-code).name
    return None


def is_follow_on(line: str) -> bool:
    text = line.lower()
    return any(
        s in text
        for s in (
            "connection closed by peer",
            "connection reset by peer",
            "broken pipe",
            "stopped by sigterm",
            "has been aborted",
        )
    )


def is_collective_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text and ("collective" in text or "watchdog" in text)


# -- hangs -----------------------------------------------------------------------------------------


def dump_stacks(run_dir: Path, rank: int, reason: str) -> Path:
    """The Python stack of every thread of this process into `<run>/hang/rank<k>.txt`."""
    path = Path(run_dir) / HANG_DIR / f"rank{rank}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"rank {rank}, pid {os.getpid()}, {PROGRESS.where}: {reason}\n"]
    for ident, frame in sys._current_frames().items():
        parts.append(
            f"\nthread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}"
        )
    path.write_text("".join(parts))
    return path


def catches_sigusr1(pid: int) -> bool:
    """Whether process `pid` has a SIGUSR1 handler (a loader worker installs its stack dump in
    worker_init, after it starts): its caught-signal mask in /proc; True where that cannot be read
    (not Linux)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return not Path("/proc/self/status").exists()
    caught = next(
        (line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), None
    )
    return caught is None or bool(int(caught, 16) >> (signal.SIGUSR1 - 1) & 1)


class Watchdog:
    """Ends this rank when `PROGRESS` has not moved for `timeout_s`, after writing the stacks (see
    module doc)."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        workers: Callable[[], list[int]],
        on_fire: Callable[[str], None],
    ):
        self.run_dir, self.rank = Path(run_dir), rank
        self._workers, self._on_fire = workers, on_fire
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="visiondist-watchdog", daemon=True)

    def start(self) -> Watchdog:
        PROGRESS.at()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, PROGRESS.limit_s / 4)):
            idle = time.monotonic() - PROGRESS.beat
            if idle >= PROGRESS.limit_s:
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        reason = f"no progress for {idle:.0f} s"
        try:
            dump_stacks(self.run_dir, self.rank, reason)
            for pid in self._workers():
                # still starting: SIGUSR1 would end it, not dump its stack
                if not catches_sigusr1(pid):
                    continue
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
            # the workers write their stacks; the peers' watchdogs fire about now too
            time.sleep(1.0)
        except OSError:
            pass
        cause = (
            f"hang: {reason} (the limit is {PROGRESS.limit_key}={PROGRESS.limit_s:g}); the stacks "
            f"of every thread are in {self.run_dir / HANG_DIR}"
        )
        self._on_fire(record_failure(self.run_dir, self.rank, None, cause))
