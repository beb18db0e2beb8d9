"""A data set's file index in arrays, and the cached listing of an ImageFolder tree.

A list of (path, label) tuples costs ~200 bytes per image in Python objects (40 MB for 200,000
files), and every forked loader worker ends up copying the pages it reads: reading a Python object
writes its reference count, so copy-on-write copies it. ImageNet-1k with 8 workers paid about 2 GB
per rank for its index. `PathIndex` holds the paths as one byte buffer with offsets (numpy arrays:
no per-path object, nothing written when read), so workers share the parent's pages.

Listing a tree of a million files takes seconds on a local disk and much longer on a network file
system, on every rank. `list_image_folder` keeps each tree's listing in the user's cache
(`$XDG_CACHE_HOME/visiondist/listings`, else `~/.cache/...`), keyed by the tree's path; a listing is
reused while every class folder's modification time is the one recorded (adding, removing or
renaming a file changes its folder's), and rebuilt otherwise; a tree changed in the last two seconds
is listed but not cached.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")
_CACHE_VERSION = 1


class PathIndex:
    """Paths relative to `root`, stored as one UTF-8 byte buffer and int64 offsets; `index[i]` is
    the full path."""

    def __init__(
        self,
        root: str | os.PathLike,
        relative: list[str] | None = None,
        *,
        buffer: np.ndarray | None = None,
        offsets: np.ndarray | None = None,
    ):
        self.root = str(root)
        if buffer is None:
            encoded = [p.encode("utf-8", "surrogateescape") for p in relative or []]
            offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
            np.cumsum([len(e) for e in encoded], out=offsets[1:])
            buffer = (
                np.frombuffer(b"".join(encoded), dtype=np.uint8)
                if encoded
                else np.zeros(0, np.uint8)
            )
        assert offsets is not None, "buffer= comes with offsets="
        self.buffer, self.offsets = buffer, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def relative(self, i: int) -> str:
        return (
            self.buffer[self.offsets[i] : self.offsets[i + 1]]
            .tobytes()
            .decode("utf-8", "surrogateescape")
        )

    def __getitem__(self, i: int) -> str:
        return os.path.join(self.root, self.relative(int(i)))

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes + self.offsets.nbytes


def _class_folders(split_dir: Path) -> list[str]:
    if not split_dir.is_dir():
        raise FileNotFoundError(
            f"{split_dir} does not exist: expected <root>/<split>/<class>/<images>"
        )
    classes = sorted(
        e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith(".")
    )
    if not classes:
        raise FileNotFoundError(f"{split_dir} has no class folders")
    return classes


def _scan(split_dir: Path, classes: list[str]) -> tuple[list[str], np.ndarray]:
    relative: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        files = sorted(
            e.name
            for e in os.scandir(split_dir / name)
            if e.is_file() and e.name.lower().endswith(IMG_EXTENSIONS)
        )
        if not files:
            raise FileNotFoundError(
                f"class folder {split_dir / name} holds no images ({', '.join(IMG_EXTENSIONS)})"
            )
        relative.extend(f"{name}/{f}" for f in files)
        labels.extend([label] * len(files))
    return relative, np.asarray(labels, dtype=np.int64)


def _cache_file(split_dir: Path) -> Path:
    base = (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "visiondist" / "listings"
    )
    key = hashlib.sha1(str(split_dir.resolve()).encode("utf-8", "surrogateescape")).hexdigest()[:20]
    return base / f"{key}.npz"


def _stamps(split_dir: Path, classes: list[str]) -> np.ndarray:
    return np.asarray([os.stat(split_dir / name).st_mtime_ns for name in classes], dtype=np.int64)


def list_image_folder(
    split_dir: str | os.PathLike, cache: bool = True
) -> tuple[list[str], PathIndex, np.ndarray]:
    """(classes in sorted order, the images' `PathIndex`, their labels) of
    `<split_dir>/<class>/<image>`; an empty class folder is an error. With `cache`, the listing
    comes from the user's cache while the tree is unchanged."""
    split_dir = Path(split_dir)
    classes = _class_folders(split_dir)
    stamps = _stamps(split_dir, classes)
    where = _cache_file(split_dir) if cache else None
    if where is not None and where.exists():
        try:
            with np.load(where, allow_pickle=False) as z:
                if (
                    int(z["version"]) == _CACHE_VERSION
                    and list(z["classes"]) == classes
                    and np.array_equal(z["stamps"], stamps)
                ):
                    return (
                        classes,
                        PathIndex(split_dir, buffer=z["buffer"], offsets=z["offsets"]),
                        z["labels"],
                    )
        except (OSError, ValueError, KeyError) as exc:  # a damaged or foreign file: list again
            log.debug("listing cache %s not used: %s", where, exc)
    relative, labels = _scan(split_dir, classes)
    index = PathIndex(split_dir, relative)
    # a folder changed in the last 2 s may change again within its time stamp's resolution (1-2 s on
    # some file systems) without a new stamp: such a listing is not kept
    if where is not None and (not len(stamps) or stamps.max() < time.time_ns() - 2_000_000_000):
        _store(where, classes, stamps, index, labels)
    return classes, index, labels


def _store(where: Path, classes, stamps, index: PathIndex, labels) -> None:
    """Write the listing atomically (ranks of one node may list the same tree at once); an
    unwritable cache only costs the next start its listing."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where.parent, suffix=".npz", delete=False) as f:
            np.savez(
                f,
                version=_CACHE_VERSION,
                classes=np.asarray(classes),
                stamps=stamps,
                buffer=index.buffer,
                offsets=index.offsets,
                labels=labels,
            )
        os.replace(f.name, where)
    except OSError as exc:
        log.debug("listing cache %s not written: %s", where, exc)
