"""One shard of a pack (`pack.py`), written by a packing process: its images decoded as the
loaders decode them (and re-encoded as JPEG where the pack asks), the tar written under a temporary
name and renamed, its record (SHA-256, size, each image's offset) kept in `.pack/`. A shard holding
an image that cannot be read is not written: every such image is named with its reason."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import tarfile
from pathlib import Path
from typing import Optional

import cv2

from visiondist.data.decode import decode_rgb, decoder_messages_named

# an image's extension in a shard: the source's, one spelling each
EXTENSIONS = {
    ".jpeg": ".jpg",
    ".jpg": ".jpg",
    ".png": ".png",
    ".webp": ".webp",
    ".bmp": ".bmp",
    ".tif": ".tif",
    ".tiff": ".tif",
    ".ppm": ".ppm",
    ".pgm": ".pgm",
}


def quiet_worker() -> None:
    """A packing process leaves stop signals to the command (which ends the pool; finished shards
    are kept)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def write_shard(args) -> dict:
    """Decode every image of the shard (as the loaders will), then write the shard; a shard holding
    an unreadable image is not written, and every such image of it is named."""
    out, job = Path(args[0]), args[1]
    images, bad = [], []
    for _, path, _ in job["samples"]:
        try:
            images.append(_image_bytes(path, job["max_side"], job["quality"]))
        except OSError as exc:
            bad.append((str(path), _reason(exc, path)))
    if bad:
        return {"name": job["name"], "bad": bad, "nsamples": len(job["samples"])}
    tmp = out / f"{job['name']}.part"
    offsets, sizes = [], []
    with (
        open(tmp, "wb") as f,
        tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar,
    ):
        for (key, _, label), (data, ext) in zip(job["samples"], images):
            offsets.append(_add(tar, f"{key:09d}{ext}", data))
            sizes.append(len(data))
            # the COCO image id; its boxes are in <split>-annotations.json
            if job["kind"] == "detection":
                _add(tar, f"{key:09d}.json", json.dumps({"image_id": label}).encode())
            else:
                _add(tar, f"{key:09d}.cls", str(label).encode())
    digest = hashlib.sha256()
    with open(tmp, "rb") as shard:
        while chunk := shard.read(1 << 20):
            digest.update(chunk)
    os.replace(tmp, out / job["name"])
    record = dict(
        name=job["name"],
        nsamples=len(job["samples"]),
        sha256=digest.hexdigest(),
        filesize=(out / job["name"]).stat().st_size,
        offsets=offsets,
        sizes=sizes,
    )
    (out / ".pack" / f"{job['name']}.json").write_text(json.dumps(record))
    return record


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> int:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0  # the same bytes on every pack
    # the member's data, after its header
    start = tar.offset + len(info.tobuf(tar.format, tar.encoding, tar.errors))
    tar.addfile(info, io.BytesIO(data))
    return start


def _reason(exc: OSError, path) -> str:
    """Why a file cannot be read, without the path the message repeats."""
    if isinstance(exc, FileNotFoundError):
        return "the file does not exist"
    text = str(exc)
    for prefix in (f"cannot decode image {path}: ", f"truncated JPEG {path}: "):
        if text.startswith(prefix):
            return ("truncated JPEG: " if prefix.startswith("truncated") else "") + text[
                len(prefix) :
            ]
    return text


def _image_bytes(path: str, max_side: Optional[int], quality: int) -> tuple[bytes, str]:
    """The image file's bytes as they are, or re-encoded as JPEG at `quality` with its longer side
    at most `max_side`; decoded in either case under the loaders' policy (EXIF orientation applied,
    so a re-encoded shard needs none): an image the loaders could not read raises OSError."""
    data = Path(path).read_bytes()
    ext = EXTENSIONS.get(Path(path).suffix.lower(), Path(path).suffix.lower())
    with decoder_messages_named(path):
        image = decode_rgb(data, path)
    if not max_side:
        return data, ext

    h, w = image.shape[:2]
    if max(h, w) > max_side:
        scale = max_side / max(h, w)
        image = cv2.resize(
            image,
            (max(1, round(w * scale)), max(1, round(h * scale))),
            interpolation=cv2.INTER_AREA,
        )
    ok, encoded = cv2.imencode(
        ".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality]
    )
    if not ok:
        raise OSError(f"cannot encode {path} as JPEG")
    return encoded.tobytes(), ".jpg"
