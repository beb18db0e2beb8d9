"""A YOLO or VOC split's COCO index in the user's cache, reused while its inputs are unchanged: the
names, sizes and modification times of its data.yaml / split list, its images and its label files
(stat'ed, not read); anything else rebuilds it. One process builds it at a time (a lock in the
cache folder); the others wait and read it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from visiondist.data.formats.exports import CocoLayout
from visiondist.data.formats.labels import SplitIndex
from visiondist.data.formats.voc import split_ids
from visiondist.data.formats.yolo import label_file, list_images, read_yaml

_VERSION = 2  # 2: duplicate objects kept once


@dataclass(frozen=True)
class Recognised:
    """What a folder holds: its format and where its parts are."""

    format: str  # yolo, voc or coco
    root: Path  # the data.yaml (yolo), the VOC folder (voc), the tree (coco)
    what: str  # how it was recognised, for the start-up line
    layout: Optional[CocoLayout] = None


def cache_folder(recognised: Recognised) -> Path:
    """Where a set's indexes live: the user's cache, one folder per set."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "visiondist"
    key = hashlib.sha1(f"{recognised.format}:{recognised.root.resolve()}".encode()).hexdigest()
    return base / "labels" / key[:16]


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _signature(files: Sequence[Path | str]) -> str:
    """The names, sizes and modification times of `files` (a missing one counts as missing)."""
    digest = hashlib.sha1()
    for path in files:
        try:
            stat = os.stat(path)
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        except FileNotFoundError:
            digest.update(f"{path}\0-\n".encode())
    return digest.hexdigest()


def inputs_of(
    recognised: Recognised, split: str, images: Optional[list[Path]] = None
) -> list[Path | str]:
    """Every file whose change changes the split's index (a YOLO split: `images`, its listing,
    where the caller has it)."""
    if recognised.layout is not None:
        return [recognised.root / recognised.layout.annotations.format(split=split)]
    if recognised.format == "yolo":
        if images is None:
            images = list_images(read_yaml(recognised.root).splits[split])
        return [recognised.root, *images, *(label_file(str(i)) for i in images)]
    listed = recognised.root / "ImageSets" / "Main" / f"{split}.txt"
    ids = split_ids(recognised.root, split)
    return [listed, *(recognised.root / "Annotations" / f"{i}.xml" for i in ids)]


def cached_index(
    recognised: Recognised, split: str, build, inputs: Sequence[Path | str]
) -> tuple[Path, dict[str, Any]]:
    """(the split's COCO file, its record: counts, problems, image root), from the cache while
    `inputs` (`inputs_of`) are unchanged, else built by `build()` (a `SplitIndex`) and stored."""
    folder = cache_folder(recognised)
    target, record_file = folder / f"{split}.json", folder / f"{split}.record.json"
    # the files stat'ed and the cache read without the lock (both files are replaced whole, the
    # record last): the ranks of a torchrun job each check it at once, not one after another
    signature = _signature(inputs)
    record = _valid_record(target, record_file, signature)
    if record is not None:
        return target, record
    with _locked(folder):
        record = _valid_record(target, record_file, signature)  # built meanwhile by another
        if record is not None:
            return target, record
        index: SplitIndex = build()
        record = {
            "version": _VERSION,
            "signature": signature,
            "image_root": str(index.image_root),
            "counts": dict(index.counts),
            "problems": [[p.file, p.line, p.reason] for p in index.problems],
            "names": [c["name"] for c in index.coco["categories"]],
        }
        for path, data in ((target, index.coco), (record_file, record)):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            tmp.replace(path)
        return target, record


def _valid_record(target: Path, record_file: Path, signature: str) -> Optional[dict[str, Any]]:
    """The cached index's record where it was built from files of this `signature`, else None."""
    if not (target.is_file() and record_file.is_file()):
        return None
    try:
        record = json.loads(record_file.read_text())
    except (ValueError, OSError):
        return None
    valid = record.get("version") == _VERSION and record.get("signature") == signature
    return record if valid else None
