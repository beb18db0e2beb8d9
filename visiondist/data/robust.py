"""Unreadable training images: logged once with their path, replaced deterministically, fatal after
a limit.

A training sample whose file is missing, empty, truncated or not an image is replaced by the next
candidate the dataset names (for classification: the next image of the same class, so labels and
class balance are unchanged; for detection: the next image). Each bad file is logged once per run
with its reason, the first `SHOWN_BAD` of them; every one is listed with its reason in
`<run>/bad_images.txt` (shared by the workers), whose files the run's summary counts; `limit`
consecutive unreadable candidates stop the run with the last path and the fix. Evaluation never
replaces: an unreadable validation image is an error, since every image must be scored exactly once
(the launcher names every one before any rank starts:
`visiondist.preflight.images.check_val_readable`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
from PIL import Image, UnidentifiedImageError

from visiondist.utils.signals import RUN_DIR_ENV

log = logging.getLogger(__name__)

# what decoders raise on a bad file (PIL: SyntaxError, ValueError)
READ_ERRORS = (OSError, ValueError, SyntaxError)


class BadImages:
    def __init__(self, limit: int, train: bool):
        self.limit, self.train = max(int(limit), 1), train
        self.seen: set[str] = set()
        self.replaced = 0

    def _record(self, path: str, reason: str) -> int | None:
        """Record `path` and why it is unreadable in `<run>/bad_images.txt` (a `path<TAB>reason`
        line, shared by the workers and ranks; the run's summary counts the files) unless it is
        there. Returns how many files were recorded before it (outside a run: this process's count),
        None when it is no news."""
        if path in self.seen:
            return None
        self.seen.add(path)
        record = bad_images_file()
        if record is None:
            return len(self.seen) - 1
        try:
            listed = (
                [line.split("\t", 1)[0] for line in record.read_text().splitlines()]
                if record.exists()
                else []
            )
            if path in listed:
                return None
            with record.open("a") as f:
                f.write(f"{path}\t{reason}\n")
            return len(set(listed))
        except OSError:
            return len(self.seen) - 1

    def read(
        self, candidates: Iterable[tuple[int, str | Path]], read: Callable[[str], np.ndarray]
    ) -> tuple[int, np.ndarray]:
        """(index, image) of the first readable candidate; the first candidate is the requested
        sample."""
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
                reason = _reason(exc, str(path))
                before = self._record(str(path), reason)
                if before is not None and before < SHOWN_BAD:
                    log.warning(
                        "cannot read %s (%s): using the next image instead (each unreadable file "
                        "is named once, the first %d here; bad_images.txt in the run dir lists "
                        "every one with its reason and the summary counts them)",
                        path,
                        reason,
                        SHOWN_BAD,
                    )
                elif before == SHOWN_BAD:
                    log.warning(
                        "more than %d unreadable training images: the others are listed in "
                        "bad_images.txt in the run dir only (the summary counts them)",
                        SHOWN_BAD,
                    )
        raise RuntimeError(
            f"{self.limit} consecutive images from index {first} could not be read (last: {last}): "
            "check the image folder, or raise data.max_bad_images"
        )


def _reason(exc: BaseException, path: str) -> str:
    """A read error in one line (decoders' messages can run over several), without the path it names
    first."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    named = text.find(f"{path}: ")
    return (text[named + len(path) + 2 :] if named >= 0 else text)[:300]


def bad_images_file() -> Path | None:
    """`<run>/bad_images.txt` of the run this process belongs to (None outside a run)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    return Path(run_dir) / "bad_images.txt" if run_dir else None


def count_bad_images(run_dir: Path) -> int:
    path = Path(run_dir) / "bad_images.txt"
    return (
        len({line.split("\t", 1)[0] for line in path.read_text().splitlines()})
        if path.is_file()
        else 0
    )


def unreadable_reason(path: str | Path) -> str | None:
    """Why an image file cannot be read, from its size, header and (JPEG) end marker alone, or None.
    Cheap: no decoding, so a whole val split is checked in seconds before training starts."""
    try:
        size = Path(path).stat().st_size
        if size == 0:
            return "the file is empty"
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(max(0, size - 4096))
            tail = f.read()
        if head == b"\xff\xd8" and b"\xff\xd9" not in tail:
            return "truncated JPEG (no end-of-image marker)"
        with Image.open(path):
            return None
    except FileNotFoundError:
        return "the file does not exist"
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as exc:
        return f"not an image ({exc})"


def check_images(paths: list[str], what: str) -> None:
    """Raise one error naming every unreadable file (`name_bad`) and the count, before any work
    depends on them."""
    bad = [(p, reason) for p in paths if (reason := unreadable_reason(p)) is not None]
    if bad:
        raise RuntimeError(
            f"{len(bad)} of {len(paths)} {what} cannot be read: {name_bad(bad)}; fix or remove "
            "them first (every evaluation image is scored; a pack holds only readable ones)"
        )


SHOWN_BAD = 10  # unreadable files a message names; a list file holds the rest


def name_bad(bad: list[tuple[str, str]], listed: Path | None = None) -> str:
    """`path: reason` of each unreadable file, sorted; past `SHOWN_BAD`, the first ones and how many
    more, with every one written to `listed` (a file, one `path<TAB>reason` a line) when given."""
    bad = sorted(bad)
    shown = "; ".join(f"{path}: {reason}" for path, reason in bad[:SHOWN_BAD])
    if len(bad) <= SHOWN_BAD:
        return shown
    more = f" and {len(bad) - SHOWN_BAD} more"
    if listed is not None:
        listed.write_text("".join(f"{path}\t{reason}\n" for path, reason in bad))
        more += f" (all {len(bad)} in {listed})"
    return shown + more
