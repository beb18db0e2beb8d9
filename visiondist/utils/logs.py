"""Loggers held at a level for a while (`held_at`): libraries whose own lines repeat what a tool
says in one line (torch's elastic agent, the ONNX exporters). A warning said once in a process
(`warn_once`): a line before launch that a Python session or a reader of several splits would
otherwise repeat. The lines a job says before its run dir exists (`say`), kept for its log file:
the launcher hands them to the ranks (`handed_on`), rank 0 writes them there (`said_before`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Iterable, Iterator

from visiondist.utils.procenv import environment_kept


@contextlib.contextmanager
def held_at(level: int, names: Iterable[str]) -> Iterator[None]:
    """The loggers `names` at `level` inside the block, their own levels back after it."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, previous in zip(loggers, levels):
            logger.setLevel(previous)


_SAID: set[str] = set()


def warn_once(text: str) -> None:
    """`warning: <text>` on stderr, the first time this process says it (kept for the run's log
    file, as `say`'s lines are)."""
    if text not in _SAID:
        _SAID.add(text)
        print(f"warning: {text}", file=sys.stderr, flush=True)
        _BEFORE.append((logging.WARNING, text))


# what this process said since its job began (`begin_job`), before the run dir existed:
# (level, line)
_BEFORE: list[tuple[int, str]] = []
# the launcher's lines as its ranks' environment holds them (JSON)
BEFORE_ENV = "VISIONDIST_SAID_BEFORE"


def say(line: str, warning: bool = False) -> None:
    """A start-up line on stdout (a file read, a layout fitted, a setting chosen; `warning`:
    `warning: <line>`), kept for the run's log file (train.log, eval.log, ...), which does not
    exist yet."""
    print(f"warning: {line}" if warning else line, flush=True)
    _BEFORE.append((logging.WARNING if warning else logging.INFO, line))


def begin_job() -> None:
    """Forget the lines of an earlier job of this process (a Python session's previous call)."""
    _BEFORE.clear()


@contextlib.contextmanager
def handed_on() -> Iterator[None]:
    """This job's lines said so far in the environment its ranks start with (and read in this
    process: one rank, or a torchrun rank), for the block."""
    with environment_kept([BEFORE_ENV]):
        os.environ[BEFORE_ENV] = json.dumps(_BEFORE)
        _BEFORE.clear()
        yield


def said_before() -> list[tuple[int, str]]:
    """The (level, line)s the job said before its run dir existed: handed on by its launcher, or
    said by this process."""
    handed = os.environ.get(BEFORE_ENV)
    lines = [(int(level), str(line)) for level, line in json.loads(handed)] if handed else []
    return lines + list(_BEFORE)
