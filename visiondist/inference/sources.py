"""What `predict.source=` names, as an ordered list of items: an image, a folder of images
(recursively), a glob, a text file of paths, or a video file (its frames, every `vid_stride`-th).
The order is fixed by the source alone (sorted paths; a list's own order; frame numbers), so that
every rank and every attempt agrees on item `i`.

A missing path or a source without images is refused here, in one line, before any rank starts; an
unreadable file inside a source is not: the rank that meets it names it once, counts it and goes on
(`read_item`)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from visiondist.config import ConfigError
from visiondist.data.index import IMG_EXTENSIONS

if TYPE_CHECKING:  # cv2 itself where a video is read (`_video`)
    import cv2

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".wmv")
LIST_EXTENSIONS = (".txt", ".lst")
KINDS = (
    "an image, a folder of images, a glob ('photos/*.jpg'), a .txt file of image paths or a video"
)


@dataclass
class Source:
    """The items of a source: image paths, or (a video) frame numbers of `video`.

    Args:
        spec: the source as given (`source=`).
        kind: image, folder, glob, list or video.
        paths: the images, in order (not a video).
        root: a folder source's folder: item names are relative to it.
        video: a video source's file.
        frames: the frame numbers a video source reads, in order.
        fps: a video's frame rate.
        size: a video's (width, height).
        arrays: images given in memory (`visiondist.predict` of arrays, PIL images, tensors):
            item i's upright HxWx3 uint8 RGB array, or None where item i is the file `paths[i]`.
        given: a list source's entries as its lines give them (the outputs' names; `paths` holds
            them resolved against the list's folder).
    """

    spec: str
    kind: str  # image | folder | glob | list | video | memory
    paths: list[str] = field(default_factory=list)
    root: Optional[str] = None  # a folder source: names are relative to it
    video: Optional[str] = None
    frames: list[int] = field(default_factory=list)
    fps: float = 0.0
    size: tuple[int, int] = (0, 0)  # a video's (width, height)
    arrays: list[Optional[np.ndarray]] = field(default_factory=list)
    given: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.frames) if self.video else len(self.paths)

    def name(self, i: int) -> str:
        """Item `i` as the outputs key it: a path as the source gave it (relative to a folder
        source), or `<video>#<frame number>`."""
        if self.video:
            return f"{Path(self.video).name}#{self.frames[i]}"
        if self.root is not None:
            return os.path.relpath(self.paths[i], self.root)
        return self.given[i] if self.given else self.paths[i]

    def image(self, i: int, frames: Optional[VideoFrames] = None) -> np.ndarray:
        """Item `i` as an upright HxWx3 uint8 RGB array (OSError when it cannot be read).

        Args:
            i: the item.
            frames: a video's reader, kept open between frames (else one is opened for this).
        """
        if self.video:
            return (frames or VideoFrames(self.video)).read(self.frames[i])
        if self.arrays and self.arrays[i] is not None:
            return self.arrays[i]  # type: ignore[return-value]
        # the one reader of the loaders (EXIF orientation, CMYK, 16-bit)
        from visiondist.data.decode import read_rgb  # noqa: PLC0415 (cv2: 16 ms)

        return read_rgb(self.paths[i])

    def describe(self) -> str:
        if self.video:
            stride = self.frames[1] - self.frames[0] if len(self.frames) > 1 else 1
            every = f", 1 frame in {stride}" if stride > 1 else ""
            return (
                f"{len(self)} frames of {self.video} ({self.size[0]}x{self.size[1]}, "
                f"{self.fps:g} fps{every})"
            )
        return f"{len(self)} image{'' if len(self) == 1 else 's'} ({self.kind} {self.spec})"


def resolve_source(spec: Optional[str], vid_stride: int = 1) -> Source:
    """The items of `spec` (module doc); ConfigError naming the fix for a missing path or a source
    without images.

    Args:
        spec: an image, a folder, a glob, a .txt list of images (a line each) or a video.
        vid_stride: a video's frames: one in every `vid_stride`.

    Returns:
        The `Source`.
    """
    if not spec:
        raise ConfigError(f"give source=<path>: {KINDS}")
    if vid_stride < 1:
        raise ConfigError(f"vid_stride={vid_stride}: give 1 (every frame) or more")
    path = Path(spec).expanduser()
    if path.is_dir():
        paths = _folder_images(path)
        if not paths:
            raise ConfigError(
                f"source={spec}: the folder holds no images ({', '.join(IMG_EXTENSIONS)}), "
                "searched recursively: give a folder of images, or a video or list file"
            )
        return Source(spec, "folder", paths, root=str(path))
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in VIDEO_EXTENSIONS:
            return _video(spec, path, vid_stride)
        if suffix in LIST_EXTENSIONS:
            return _listed(spec, path)
        if suffix not in IMG_EXTENSIONS:
            raise ConfigError(
                f"source={spec}: not an image ({', '.join(IMG_EXTENSIONS)}), a video "
                f"({', '.join(VIDEO_EXTENSIONS)}) or a list of paths ({', '.join(LIST_EXTENSIONS)})"
            )
        return Source(spec, "image", [str(path)])
    if glob.has_magic(spec):
        paths = sorted(
            p
            for p in glob.glob(os.path.expanduser(spec), recursive=True)
            if p.lower().endswith(IMG_EXTENSIONS) and os.path.isfile(p)
        )
        if not paths:
            raise ConfigError(
                f"source={spec}: the glob matches no images ({', '.join(IMG_EXTENSIONS)}); quote "
                "it so that the shell does not expand it, e.g. source='photos/**/*.jpg'"
            )
        return Source(spec, "glob", paths)
    raise ConfigError(f"source={spec}: no such file or folder: give {KINDS}")


def _folder_images(folder: Path) -> list[str]:
    found: list[str] = []
    for here, dirs, files in os.walk(folder, followlinks=True):
        dirs.sort()
        found.extend(os.path.join(here, f) for f in files if f.lower().endswith(IMG_EXTENSIONS))
    return sorted(found)


def _listed(spec: str, path: Path) -> Source:
    """A text file of image paths, one a line (blank lines and `#` comments skipped); a relative
    path is read from the list's own folder."""
    paths, given = [], []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            listed = Path(line).expanduser()
            paths.append(str(listed if listed.is_absolute() else path.parent / listed))
            given.append(line)
    if not paths:
        raise ConfigError(f"source={spec}: the list names no image: write one image path a line")
    return Source(spec, "list", paths, given=given)


def _video(spec: str, path: Path, stride: int) -> Source:
    # cv2 (0.02-0.04 s) here and below: tools/predict.py reads this module for its one-line
    # errors, before its config is checked (no torch, no OpenCV there)
    import cv2  # noqa: PLC0415 (cv2: a video's alone)

    capture = cv2.VideoCapture(str(path))
    try:
        if not capture.isOpened():
            raise ConfigError(
                f"source={spec}: OpenCV cannot open this video (its FFmpeg reads mp4, avi, mov, "
                "mkv, webm): convert it, e.g. ffmpeg -i in.xyz out.mp4"
            )
        count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        fps = float(capture.get(cv2.CAP_PROP_FPS)) or 25.0
        size = (
            int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
            int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)),
        )
    finally:
        capture.release()
    if count <= 0:
        raise ConfigError(f"source={spec}: the video has no frames")
    return Source(
        spec, "video", video=str(path), frames=list(range(0, count, stride)), fps=fps, size=size
    )


class VideoFrames:
    """Frames of one video read in increasing order (a rank's contiguous share), seeking only for a
    jump."""

    def __init__(self, path: str):
        self.path, self.position = path, 0
        self.capture: Optional[cv2.VideoCapture] = None

    def read(self, frame: int) -> np.ndarray:
        import cv2  # noqa: PLC0415 (cv2: a video's alone)

        if self.capture is None:
            self.capture = cv2.VideoCapture(self.path)
        if frame < self.position or frame - self.position > 250:
            self.capture.set(cv2.CAP_PROP_POS_FRAMES, frame)
            self.position = frame
        while self.position < frame:
            if not self.capture.grab():
                break
            self.position += 1
        ok, image = self.capture.read()
        self.position += 1
        if not ok or image is None:
            raise OSError(
                f"frame {frame} of {self.path} cannot be decoded (past the video's end, or damaged)"
            )
        return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)

    def close(self) -> None:
        if self.capture is not None:
            self.capture.release()
            self.capture = None
