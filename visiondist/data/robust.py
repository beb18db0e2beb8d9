"""Unreadable training images: logged once with their path, replaced deterministically, fatal after a limit.

A training sample whose file is missing, empty, truncated or not an image is replaced by the next candidate the
dataset names (for classification: the next image of the same class, so labels and class balance are unchanged; for
detection: the next image). Each bad file is logged once per loader worker with the running count; `limit`
consecutive unreadable candidates stop the run with the last path and the fix. Evaluation never replaces: an
unreadable validation image is an error, since every image must be scored exactly once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

log = logging.getLogger(__name__)

READ_ERRORS = (OSError, ValueError, SyntaxError)  # what decoders raise on a bad file (PIL: SyntaxError, ValueError)


class BadImages:
    def __init__(self, limit: int, train: bool):
        self.limit, self.train = max(int(limit), 1), train
        self.seen: set[str] = set()
        self.replaced = 0

    def read(self, candidates: Iterable[tuple[int, str | Path]], read: Callable[[str], np.ndarray]
             ) -> tuple[int, np.ndarray]:
        """(index, image) of the first readable candidate; the first candidate is the requested sample."""
        first = last = None
        for attempt, (index, path) in enumerate(candidates):
            if attempt == self.limit:
                break
            first = index if first is None else first
            last = path
            try:
                return index, read(str(path))
            except READ_ERRORS as exc:
                if not self.train:
                    raise RuntimeError(f"cannot read evaluation image {path}: {exc}") from exc
                self.replaced += 1
                if str(path) not in self.seen:
                    self.seen.add(str(path))
                    log.warning("cannot read %s (%s): using the next image instead (%d replaced so far)",
                                path, exc, self.replaced)
        raise RuntimeError(f"{self.limit} consecutive images from index {first} could not be read (last: {last}): "
                           "check the image folder, or raise data.max_bad_images")
