"""Loggers held at a level for a while (`held_at`): libraries whose own lines repeat what a tool
says in one line (torch's elastic agent, the ONNX exporters). A warning said once in a process
(`warn_once`): a line before launch that a Python session or a reader of several splits would
otherwise repeat."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterable, Iterator


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
    """`warning: <text>` on stderr, the first time this process says it."""
    if text not in _SAID:
        _SAID.add(text)
        print(f"warning: {text}", file=sys.stderr, flush=True)
