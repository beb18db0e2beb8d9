"""The built-in `shapes` dataset: coloured geometric shapes on textured backgrounds, written as real
JPEG files in an ImageFolder tree (`<root>/<split>/<class>/<n>.jpg`), so the loader that reads it is
the one that reads ImageNet.

Generation is deterministic: image n of a split depends only on (seed, split, n). The tree is built
in a temporary folder and renamed into place, so a folder at `root` is always complete, even with
several processes racing.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import shutil
import socket
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import Image, ImageDraw, ImageFilter
from rich.progress import track

log = logging.getLogger(__name__)

SHAPE_CLASSES = ("circle", "square", "triangle", "star", "cross", "ring")
SPLITS = {"train": 0, "val": 1}
SUPERSAMPLE = 2  # draw at 2x and downsample, for anti-aliased edges


def _polygon(
    cx: float, cy: float, r: float, corners: int, angle: float, inner: float | None = None
) -> list:
    """Vertices of a regular polygon (or a star when `inner` gives the inner radius ratio)."""
    points = []
    steps = corners * (2 if inner else 1)
    for i in range(steps):
        radius = r * (inner if inner and i % 2 else 1.0)
        a = angle + 2 * math.pi * i / steps
        points.append((cx + radius * math.cos(a), cy + radius * math.sin(a)))
    return points


def _cross(cx: float, cy: float, r: float, angle: float) -> list:
    w = 0.36 * r
    arm = [
        (-w, -r),
        (w, -r),
        (w, -w),
        (r, -w),
        (r, w),
        (w, w),
        (w, r),
        (-w, r),
        (-w, w),
        (-r, w),
        (-r, -w),
        (-w, -w),
    ]
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in arm]


def background(rng: np.random.Generator, size: int) -> Image.Image:
    """Smooth colour gradient + stripes + noise, so the class is never readable from the
    background."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    c0, c1 = rng.uniform(0, 120, 3), rng.uniform(0, 120, 3)  # darker than any shape
    t = (
        xx * math.cos(rng.uniform(0, 2 * math.pi)) + yy * math.sin(rng.uniform(0, 2 * math.pi)) + 1
    ) / 3
    img = c0 * (1 - t[..., None]) + c1 * t[..., None]
    freq, phase = rng.uniform(2, 8), rng.uniform(0, 2 * math.pi)
    stripes = np.sin(2 * math.pi * freq * (xx if rng.random() < 0.5 else yy) + phase)
    img += rng.uniform(0, 20) * stripes[..., None]
    img += rng.normal(0, rng.uniform(2, 8), img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def _bright_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    colour = rng.uniform(60, 255, 3)
    colour[rng.integers(3)] = 255  # one saturated channel: always brighter than the background
    return int(colour[0]), int(colour[1]), int(colour[2])


def draw_shape(
    draw: ImageDraw.ImageDraw, name: str, cx: float, cy: float, r: float, rng: np.random.Generator
) -> list:
    """Draw one shape of radius `r` centred at (cx, cy) in a random bright colour and angle; return
    its outline points (for the tight box)."""
    angle = rng.uniform(0, 2 * math.pi)
    fill = _bright_colour(rng)
    if name in ("circle", "ring"):
        box = [cx - r, cy - r, cx + r, cy + r]
        if name == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.ellipse(box, outline=fill, width=max(2, int(0.3 * r)))
        return [(box[0], box[1]), (box[2], box[3])]
    if name == "square":
        points = _polygon(cx, cy, r, 4, angle)
    elif name == "triangle":
        points = _polygon(cx, cy, r, 3, angle)
    elif name == "star":
        points = _polygon(cx, cy, r, 5, angle, inner=0.45)
    elif name == "cross":
        points = _cross(cx, cy, r, angle)
    else:
        raise ValueError(f"unknown shape {name!r}")
    draw.polygon(points, fill=fill)
    return points


def render_shape(
    label: int, rng: np.random.Generator, size: int, aspect: float = 1.0
) -> Image.Image:
    """One image of class `label`, fully determined by `rng`'s state: `size` x `size`, or with
    `aspect` (width over height) `size` * sqrt(aspect) wide and `size` / sqrt(aspect) high, the
    shape sized to the short side."""
    width, height = (
        (size, size)
        if aspect == 1.0
        else (max(8, round(size * math.sqrt(aspect))), max(8, round(size / math.sqrt(aspect))))
    )
    big_w, big_h = width * SUPERSAMPLE, height * SUPERSAMPLE
    img = background(rng, max(big_w, big_h))
    if (big_w, big_h) != img.size:
        img = img.crop((0, 0, big_w, big_h))
    draw = ImageDraw.Draw(img)
    r = rng.uniform(0.28, 0.42) * min(big_w, big_h)
    # the shape stays inside; its centre in the middle half of the free range
    jx, jy = big_w / 2 - r, big_h / 2 - r
    cx, cy = big_w / 2 + jx * rng.uniform(-1, 1) * 0.5, big_h / 2 + jy * rng.uniform(-1, 1) * 0.5
    draw_shape(draw, SHAPE_CLASSES[label], cx, cy, r, rng)
    img = img.filter(ImageFilter.GaussianBlur(radius=rng.uniform(0, 1.0)))
    return img.resize((width, height), Image.Resampling.LANCZOS)


def spec_of_shapes(synthetic) -> dict:
    """What a `shapes` copy is made of: the dataset.json a generated copy holds.

    Args:
        synthetic: the data config's `synthetic` group (images per class, size, seed).

    Returns:
        The spec, which a copy at `data.root` must match.
    """
    return {
        "dataset": "shapes",
        "classes": list(SHAPE_CLASSES),
        "train_per_class": int(synthetic.train_per_class),
        "val_per_class": int(synthetic.val_per_class),
        "image_size": int(synthetic.image_size),
        "seed": int(synthetic.seed),
        # images of mixed aspect ratios (data.resolution=native): only in the spec of such a set
        **(
            {"max_aspect": float(a)}
            if (a := getattr(synthetic, "max_aspect", 1.0) or 1.0) != 1.0
            else {}
        ),
    }


def _write_split(tmp: Path, split: str, per_class: int, spec: dict, progress) -> None:
    for name in SHAPE_CLASSES:
        (tmp / split / name).mkdir(parents=True)
    for n in progress(range(per_class * len(SHAPE_CLASSES)), f"generating shapes/{split}"):
        label = n % len(SHAPE_CLASSES)
        rng = np.random.default_rng([spec["seed"], SPLITS[split], n])
        aspect = 1.0
        # its own stream: the square set's images stay as they were
        if spec.get("max_aspect", 1.0) != 1.0:
            ratio = math.log(spec["max_aspect"])
            aspect = math.exp(
                np.random.default_rng([spec["seed"], SPLITS[split], n, 1]).uniform(-ratio, ratio)
            )
        img = render_shape(label, rng, spec["image_size"], aspect)
        img.save(tmp / split / SHAPE_CLASSES[label] / f"{n:06d}.jpg", quality=92)


def _no_progress(items, _description):
    return items


def _tracker(show_progress: bool):
    if not show_progress:
        return _no_progress

    def progress(items, description):
        return track(items, description=description, transient=True)

    return progress


def ensure(root: str | os.PathLike, spec: dict, write, show_progress: bool) -> Path:
    """Build a dataset with `write(tmp_dir, progress)` unless a complete copy with the same spec is
    at `root`. Written to a temporary folder and renamed into place, so a folder at `root` is always
    complete."""
    root = Path(root).expanduser()
    problem = conflict(root, spec)
    if problem:
        raise ValueError(problem)
    meta = root / "dataset.json"
    if meta.exists():
        if json.loads(meta.read_text()) == spec:
            return root
        return _regenerate(root, spec, write, show_progress)

    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("generating the built-in %s dataset in %s", spec["dataset"], root)
    write(tmp, _tracker(show_progress))
    (tmp / "dataset.json").write_text(json.dumps(spec, indent=2))
    try:
        if root.exists():
            root.rmdir()  # an empty folder left by the user; anything else was refused above
        os.rename(tmp, root)
    except OSError:
        if not meta.exists():  # another process did not win the race either: a real failure
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def ensure_shapes(root: str | os.PathLike, synthetic, show_progress: bool = False) -> Path:
    """Generate the classification set at `root` unless a complete copy with the same spec is
    already there.

    Args:
        root: the set's folder (`data.root`).
        synthetic: the data config's `synthetic` group.
        show_progress: a progress bar while the images are written.

    Returns:
        `root`, holding the set.
    """
    spec = spec_of_shapes(synthetic)

    def write(tmp: Path, progress) -> None:
        _write_split(tmp, "train", spec["train_per_class"], spec, progress)
        _write_split(tmp, "val", spec["val_per_class"], spec, progress)

    return ensure(root, spec, write, show_progress)


# --------------------------------------------------------------------------------------------------


def conflict(root: Path, spec: dict) -> Optional[str]:
    """Why the folder at `root` cannot hold the built-in set `spec`, or None.

    Why the folder at `root` cannot hold the built-in set `spec` (another spec's copy, or other
    files), with the fix; None where it can: absent, empty, the same copy, or an earlier generator's
    (made again).

    Args:
        root: the set's folder.
        spec: the set's spec (`spec_of_shapes`, `spec_of_shapes_coco`).

    Returns:
        The reason with its fix, or None.
    """
    meta = root / "dataset.json"
    if meta.exists():
        found = json.loads(meta.read_text())
        if found == spec or _older_version(found, spec):
            return None
        made = " ".join(
            f"data.synthetic.{k}={found[k]}"
            for k in found
            if k not in ("dataset", "version", "classes") and found[k] != spec.get(k)
        )
        if found.get("dataset") == spec.get("dataset") and made:
            return (
                f"{root} holds the {found.get('dataset')} dataset generated with other settings: "
                f"add {made} to read it as it is, or point data.root elsewhere (or delete that "
                "folder) to generate the requested one"
            )
        return (
            f"{root} holds a {found.get('dataset')} dataset generated with {found}, not the "
            f"requested {spec}: delete that folder or point data.root elsewhere (or give the "
            "data.synthetic settings it was made with)"
        )
    if root.exists() and any(root.iterdir()):
        return f"{root} is not the built-in {spec['dataset']} set: {_own_data(root)}"
    return None


def _own_data(root: Path) -> str:
    """How to read a user's own folder that a built-in set's config was pointed at: the data group
    its layout asks for, or both layouts."""
    from visiondist.config import ConfigError  # noqa: PLC0415 (the formats' reader)
    from visiondist.data.formats.resolve import recognise  # noqa: PLC0415

    try:
        found = recognise(root) if root.is_dir() else None
    except (ConfigError, OSError, ValueError):
        found = None
    if found is not None:
        return f"it holds {found.what}: read it with data=detection data.root={root}"
    train = root / "train"
    if train.is_dir() and any(p.is_dir() for p in train.iterdir()):
        return (
            f"it holds class folders (train/<class>/): read it with data=imagenet data.root={root}"
        )
    return (
        "for your own data add data=imagenet (class folders: train/<class>/, val/<class>/) or "
        "data=detection (a YOLO, Pascal VOC or COCO set), or point data.root elsewhere"
    )


def _older_version(found: dict, spec: dict) -> bool:
    """`found` is the same built-in set made by an earlier generator (e.g. shapes_coco before it had
    masks)."""
    rest = {k: v for k, v in spec.items() if k != "version"}
    return {k: v for k, v in found.items() if k != "version"} == rest and int(
        found.get("version", 1)
    ) < int(spec.get("version", 1))


def _regenerate(root: Path, spec: dict, write, show_progress: bool) -> Path:
    """Replace an older generator's copy at `root` (under a lock, so that concurrent jobs on a node
    do it once): the new one is written beside it, then swapped in."""
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # another job replaced it meanwhile
        if json.loads((root / "dataset.json").read_text()) == spec:
            return root
        log.info(
            "the built-in %s dataset in %s is from an earlier version: generating it again",
            spec["dataset"],
            root,
        )
        tmp = root.parent / f".{root.name}.tmp-{socket.gethostname()}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp, _tracker(show_progress))
        (tmp / "dataset.json").write_text(json.dumps(spec, indent=2))
        old = root.parent / f".{root.name}.old-{socket.gethostname()}-{os.getpid()}"
        os.rename(root, old)
        os.rename(tmp, root)
        shutil.rmtree(old, ignore_errors=True)
    return root
