"""Progress people watch while work runs: the training bar over the optimizer steps, a transient bar
over an evaluation's batches (which also feeds the rank's hang watchdog), a spinner over a long step
without batches.

In a Jupyter notebook there is one bar, the training bar, drawn as one widget updated in place (rich
with ipywidgets): by the rank when it runs in the kernel, else by the launching kernel from what
rank 0 writes to a small feed file (`FedBar`, `drawn_from_feed`); ranks forked from a kernel cannot
display anything in it themselves."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Iterator, Optional

from rich import get_console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    track,
)

from visiondist.utils.heartbeat import PROGRESS

log = logging.getLogger(__name__)


# the file rank 0 writes its training bar's state to, for the launching process to draw
FEED_ENV = "VISIONDIST_PROGRESS_FEED"


def in_notebook() -> bool:
    """This process draws into a Jupyter notebook: rich's console is the kernel's, and ipywidgets
    is there to update one widget in place (without it each refresh would be a new output)."""
    return get_console().is_jupyter and importlib.util.find_spec("ipywidgets") is not None


def fed() -> bool:
    """This rank's training bar is drawn by the launching process (`FEED_ENV`)."""
    return bool(os.environ.get(FEED_ENV))


class FedBar:
    """Rank 0's training bar when the launching process draws it: each update's step and figures
    written to the feed file (atomically, at most every `EVERY_S` seconds, and at the end)."""

    EVERY_S = 0.5

    def __init__(self, path: Path, total: int):
        self.path, self.state = path, {"total": total, "completed": 0, "stats": ""}
        self.written = 0.0
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)
        self.written = time.monotonic()

    def update(self, _task: int, completed: Optional[int] = None, stats: Optional[str] = None):
        if completed is not None:
            self.state["completed"] = completed
        if stats is not None:
            self.state["stats"] = stats
        if time.monotonic() - self.written >= self.EVERY_S or completed == self.state["total"]:
            self._write()

    def stop(self) -> None:
        self._write()


@contextlib.contextmanager
def drawn_from_feed(path: Optional[Path]) -> Iterator[None]:
    """In the launching process: the training bar of the rank 0 whose `FedBar` writes `path`,
    drawn here while the block runs (ranks started with `FEED_ENV` set); None: nothing drawn."""
    if path is None:
        yield
        return
    bar = _rich_bar(None)  # shown now, from this thread (a notebook shows it in this cell)
    done = threading.Event()

    def read() -> Optional[dict]:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # not written yet, or being replaced
            return None

    def show(state: Optional[dict]) -> None:
        if state is not None:
            bar.update(
                TaskID(0), total=state["total"], completed=state["completed"], stats=state["stats"]
            )

    def draw() -> None:
        while not done.wait(0.25):
            show(read())

    previous = os.environ.get(FEED_ENV)
    os.environ[FEED_ENV] = str(path)
    thread = threading.Thread(target=draw, name="visiondist-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if previous is None:
            os.environ.pop(FEED_ENV, None)
        else:
            os.environ[FEED_ENV] = previous
        show(read())
        bar.stop()
        path.unlink(missing_ok=True)


def progress_bar(enabled: bool, total: int):
    """A rich progress bar over the optimizer steps (None when disabled): the bar, steps done, the
    latest log line's figures (epoch, loss, lr, images/s, GPU memory), elapsed and remaining
    time; a `FedBar` where the launching process draws it.

    Args:
        enabled: a bar is wanted here.
        total: the optimizer steps of the run.

    Returns:
        An object with `update(task, completed=, stats=)` and `stop()`, or None.
    """
    if not enabled:
        return None
    if fed():
        return FedBar(Path(os.environ[FEED_ENV]), total)
    return _rich_bar(total)


class _Bar(Progress):
    """rich's bar, drawn once more as it stops (in a notebook rich's `stop` does not draw, so a
    short run's widget would keep its last periodic refresh)."""

    def stop(self) -> None:
        self.refresh()
        super().stop()


def _rich_bar(total: Optional[int]) -> Progress:
    """The rich training bar, started (`total` None: not known yet)."""
    progress = _Bar(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    )
    progress.start()
    progress.add_task("train", total=total, stats="")
    return progress


# into a pipe or a file, where no bar is drawn: a line at most this often while work goes on
PIPE_LINE_S = 30.0


def tracked(items, enabled: bool, description: str = "eval", total: int | None = None):
    """`items` with a transient rich progress bar while they are consumed (rank 0 with
    `trainer.progress`), e.g. an evaluation's batches; under the live training bar it shows beneath
    it. Into a pipe or a file (no bar), a log line every `PIPE_LINE_S` seconds says how far it is.
    Every item also tells the rank's hang watchdog that the work moves (on every rank). `total`:
    the count, for items without a length."""
    count = total if total is not None else len(items)

    def beating(iterable, say: bool = False):
        start = last = time.monotonic()
        for done, item in enumerate(iterable):
            PROGRESS.at()
            now = time.monotonic()
            if say and now - last >= PIPE_LINE_S:
                last = now
                log.info("%s: %d of %d batches in %.0f s", description, done, count, now - start)
            yield item

    console = get_console()
    if not enabled or console.is_jupyter:  # a notebook: the training bar alone
        return beating(items)
    if not console.is_terminal:
        return beating(items, say=True)
    return beating(track(items, description=description, total=count, transient=True))


def status(enabled: bool, text: str):
    """A transient spinner with `text` while a long step without batches runs (e.g. COCO scoring on
    rank 0); without a spinner (`trainer.progress=false`, a pipe) the text is logged once instead,
    so a long wait is explained."""
    if not enabled or get_console().is_jupyter:  # a notebook: the training bar alone
        log.info("%s ...", text)
        return nullcontext()

    return get_console().status(text)
