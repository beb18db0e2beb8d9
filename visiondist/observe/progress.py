"""Progress people watch while work runs: the training bar over the optimizer steps, a transient bar
over an evaluation's batches (which also feeds the rank's hang watchdog), a spinner over a long step
without batches."""

from __future__ import annotations

import logging
from contextlib import nullcontext

from rich import get_console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    track,
)

from visiondist.utils.heartbeat import PROGRESS

log = logging.getLogger(__name__)


def progress_bar(enabled: bool, total: int):
    """A rich progress bar over the optimizer steps (None when disabled): the bar, steps done, the
    latest log line's figures (epoch, loss, lr, images/s, GPU memory), elapsed and remaining
    time."""
    if not enabled:
        return None

    progress = Progress(
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


def tracked(items, enabled: bool, description: str = "eval", total: int | None = None):
    """`items` with a transient rich progress bar while they are consumed (rank 0 with
    `trainer.progress`), e.g. an evaluation's batches; under the live training bar it shows beneath
    it. Every item also tells the rank's hang watchdog that the work moves (on every rank). `total`:
    the count, for items without a length."""

    def beating(iterable):
        for item in iterable:
            PROGRESS.at()
            yield item

    if not enabled:
        return beating(items)

    return beating(
        track(
            items,
            description=description,
            total=total if total is not None else len(items),
            transient=True,
        )
    )


def status(enabled: bool, text: str):
    """A transient spinner with `text` while a long step without batches runs (e.g. COCO scoring on
    rank 0); without a spinner (`trainer.progress=false`, a pipe) the text is logged once instead,
    so a long wait is explained."""
    if not enabled:
        log.info("%s ...", text)
        return nullcontext()

    return get_console().status(text)
