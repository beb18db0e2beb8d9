"""The one image reader of every loader (classification, detection, the val-prediction plots, the
export's check): an image file -> HxWx3 uint8 RGB, the same pixels whichever loader asks.

Policy (docs/classification.md and docs/detection.md, "How images are decoded"; recorded in the
export's sidecar):
- the EXIF orientation is applied (JPEG, PNG, WebP, TIFF): the image comes out upright, as a phone,
  a viewer and COCO's tools show it and as detectron2 and Ultralytics read it, so boxes annotated on
  the upright image fit it;
- 16-bit samples become 8-bit by their high byte (`value >> 8`: 28784 -> 112, 65535 -> 255), never
  clipped;
- grey is replicated to three channels, palettes are expanded, CMYK is converted to RGB, and an
  alpha channel is dropped: the colour channels as stored, not composited on any background (as
  Pillow's `convert("RGB")`).

OpenCV decodes (`imdecode`: the fastest CPU JPEG decoder we measured), ignoring its own EXIF
handling, which depends on its version (PNG and WebP orientation came late); the orientation tag is
read with Pillow and applied here, as `PIL.ImageOps.exif_transpose` would. TIFF files (which OpenCV
turns by their orientation whatever the flags) and files OpenCV cannot decode go through Pillow,
under the same policy. libjpeg's and libpng's warnings, which name no file, can be prefixed with
the file's path while it decodes (`decoder_messages_named`: the shard packer's workers).
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import cv2
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

_RGB = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.10 decodes straight to RGB
_FLAGS = (cv2.IMREAD_COLOR if _RGB is None else _RGB) | cv2.IMREAD_IGNORE_ORIENTATION
_ORIENTATION_TAG = 0x0112
_TIFF = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # little / big endian, classic and BigTIFF
# EXIF orientation -> the transform that makes the stored pixels upright
# (PIL.ImageOps.exif_transpose's table)
_UPRIGHT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    2: lambda a: cv2.flip(a, 1),
    3: lambda a: cv2.rotate(a, cv2.ROTATE_180),
    4: lambda a: cv2.flip(a, 0),
    5: cv2.transpose,
    6: lambda a: cv2.rotate(a, cv2.ROTATE_90_CLOCKWISE),
    7: lambda a: cv2.rotate(cv2.transpose(a), cv2.ROTATE_180),
    8: lambda a: cv2.rotate(a, cv2.ROTATE_90_COUNTERCLOCKWISE),
}
POLICY = {
    "reader": "visiondist.data.decode.read_rgb",
    "exif_orientation": "applied (as PIL.ImageOps.exif_transpose)",
    "16_bit": "scaled to 8 bits by the high byte (value >> 8)",
    "alpha": "dropped (not composited)",
    "grey_palette_cmyk": "converted to RGB",
}


def read_rgb(path: str | Path) -> np.ndarray:
    """Decode an image file to an upright HxWx3 uint8 RGB array (the module's policy); OSError when
    it cannot."""
    return decode_rgb(Path(path).read_bytes(), path)


def decode_rgb(data: bytes, path: str | Path) -> np.ndarray:
    """`read_rgb` of an image file's bytes (`path` names it in errors: a file, or a member of a
    shard)."""
    if not data:
        raise OSError(f"cannot decode image {path}: the file is empty")
    jpeg = data[:2] == b"\xff\xd8"
    # OpenCV would decode it, grey below the cut, with only a warning
    if jpeg and b"\xff\xd9" not in data[-4096:]:
        raise OSError(f"truncated JPEG {path}: no end-of-image marker")
    # OpenCV's TIFF decoder turns the image by its orientation tag whatever the flags: Pillow
    # decodes TIFF
    image = None if data[:4] in _TIFF else decode_opencv(data, jpeg)
    if image is None:
        return decode_pillow(data, path)
    orientation = exif_orientation(data) if _may_carry_orientation(data, jpeg) else 1
    return _UPRIGHT[orientation](image) if orientation in _UPRIGHT else image


def decode_opencv(data: bytes, jpeg: bool) -> np.ndarray | None:
    """The stored pixels as HxWx3 uint8 RGB, or None when OpenCV cannot decode the bytes. 16-bit
    files are read at full depth and scaled here (OpenCV's own 16 -> 8 bit conversion differs
    between codecs); JPEG is left to OpenCV (a 12-bit JPEG is not a full-range 16-bit image)."""
    buffer = np.frombuffer(data, np.uint8)
    image = cv2.imdecode(buffer, _FLAGS if jpeg else _FLAGS | cv2.IMREAD_ANYDEPTH)
    # float or 32-bit: OpenCV's own conversion
    if image is not None and image.dtype not in (np.uint8, np.uint16):
        image = cv2.imdecode(buffer, _FLAGS)
    if image is None:
        return None
    if image.dtype == np.uint16:
        # astype(copy=False) copies nothing here: it tells the type checker the dtype
        image = (image.astype(np.uint16, copy=False) >> 8).astype(np.uint8)
    return image if _RGB is not None else cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def upright_rgb(image: Image.Image) -> np.ndarray:
    """A Pillow image as the loader reads its file: its EXIF orientation applied
    (`ImageOps.exif_transpose`), HxWx3 uint8 RGB, writable (a file, or an image given in memory)."""
    im = ImageOps.exif_transpose(image)
    # I;16, I;16B, I (Pillow's 16-bit grey): the high byte of 16 bits
    if im.mode.startswith("I"):
        grey = (np.clip(np.asarray(im, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(grey[..., None], 3, axis=2))
    return np.array(im.convert("RGB"))  # writable, as OpenCV's


def decode_pillow(data: bytes, path: str | Path) -> np.ndarray:
    """The upright pixels as HxWx3 uint8 RGB through Pillow (TIFF, and formats this OpenCV build
    cannot read); `ImageOps.exif_transpose` applies the orientation (Pillow's TIFF decoder may
    already have)."""
    try:
        with Image.open(io.BytesIO(data)) as source:
            source.load()
            return upright_rgb(source)
    # Pillow raises many kinds on a broken file (OSError, SyntaxError, DecompressionBomb)
    except Exception as exc:
        reason = (
            "not an image OpenCV or Pillow can read"
            if isinstance(exc, UnidentifiedImageError)
            else str(exc)
        )  # (Pillow's own text names the in-memory buffer, not the file)
        raise OSError(f"cannot decode image {path}: {reason}") from exc


def exif_orientation(data: bytes) -> int:
    """The file's orientation tag (1-8, as Pillow's `getexif()` reads it, XMP included); 1 when
    absent or unreadable."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            value = int(im.getexif().get(_ORIENTATION_TAG, 1))
    except Exception:  # no metadata Pillow understands: the pixels as stored
        return 1
    return value if 1 <= value <= 8 else 1


def _may_carry_orientation(data: bytes, jpeg: bool) -> bool:
    """Whether the file can hold an orientation tag, from its segments alone: JPEG's APP1 (EXIF or
    XMP), PNG's eXIf or XMP / EXIF text chunks; any other format is asked. Skips Pillow for the
    common untagged JPEG and PNG (Pillow decodes a whole PNG to look for a late eXIf chunk)."""
    if jpeg:
        return _jpeg_has_app1(data)
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return _png_has_metadata(data)
    return True


def _jpeg_has_app1(data: bytes) -> bool:
    return any(marker == 0xE1 for marker, _ in _jpeg_segments(data))


class JpegFrame(NamedTuple):
    """What a JPEG's header says: the frame's size, sample precision and component count, which SOF
    marker (0: baseline, 1: extended, 2: progressive, ...) and whether it has an APP1 (EXIF / XMP)
    segment."""

    height: int
    width: int
    components: int
    precision: int
    sof: int
    app1: bool


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_segments(data: bytes):
    """(marker, payload offset) of each header segment up to the start of scan."""
    i = 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xDA:  # start of scan: the header segments are over
            return
        yield marker, i + 4
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")


def jpeg_frame(data: bytes) -> JpegFrame | None:
    """The frame header of a JPEG's bytes (read from its segments, nothing decoded), or None when it
    has none."""
    app1, frame = False, None
    for marker, at in _jpeg_segments(data):
        app1 = app1 or marker == 0xE1
        if frame is None and marker in _SOF and at + 6 <= len(data):
            frame = (
                int.from_bytes(data[at + 1 : at + 3], "big"),
                int.from_bytes(data[at + 3 : at + 5], "big"),
                data[at + 5],
                data[at],
                marker - 0xC0,
            )
    return None if frame is None else JpegFrame(*frame, app1=app1)


# text chunks Pillow takes orientation from
_PNG_EXIF_TEXT = (b"XML:com.adobe.xmp\x00", b"Raw profile type exif\x00")


def _png_has_metadata(data: bytes) -> bool:
    i = 8
    while i + 8 <= len(data):
        kind = data[i + 4 : i + 8]
        if kind == b"eXIf" or (
            kind in (b"iTXt", b"zTXt", b"tEXt") and data[i + 8 : i + 30].startswith(_PNG_EXIF_TEXT)
        ):
            return True
        if kind == b"IEND":
            return False
        i += 12 + int.from_bytes(data[i : i + 4], "big")
    return False


# pid -> this process's file that the decoder's stderr goes to while it decodes (made once)
_CAPTURE: dict = {}


@contextmanager
def decoder_messages_named(path) -> Iterator[None]:
    """libjpeg writes its warnings ("Corrupt JPEG data: premature end of data segment") straight to
    the process's stderr, naming no file: while the body decodes `path`, they go to a file, and come
    out on stderr after it, each line with the path in front (other text on stderr meanwhile, e.g. a
    progress bar's, unchanged)."""
    # a forked worker makes its own: one inherited would be shared with its sibling workers
    pid = os.getpid()
    if pid not in _CAPTURE:
        _CAPTURE.clear()
        _CAPTURE[pid] = tempfile.TemporaryFile()
    capture = _CAPTURE[pid]
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(capture.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        size = os.lseek(capture.fileno(), 0, os.SEEK_END)
        if size:
            text = os.pread(capture.fileno(), size, 0).decode(errors="replace")
            os.ftruncate(capture.fileno(), 0)
            # the next message at the start, not after a hole of NULs
            os.lseek(capture.fileno(), 0, os.SEEK_SET)
            sys.stderr.write(
                "".join(
                    f"{path}: {line}\n" if line.startswith(_DECODER_WARNINGS) else line + "\n"
                    for line in text.splitlines()
                )
            )
            sys.stderr.flush()


_DECODER_WARNINGS = (
    "Corrupt JPEG data",
    "Premature end of JPEG file",
    "Invalid SOS parameters",
    "libpng warning",
    "Warning:",
    "Unknown Adobe",
)
