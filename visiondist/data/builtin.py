"""The built-in `shapes` dataset: coloured geometric shapes on textured backgrounds, written as real JPEG files in an
ImageFolder tree (`<root>/<split>/<class>/<n>.jpg`), so the loader that reads it is the one that reads ImageNet.

Generation is deterministic: image n of a split depends only on (seed, split, n). The tree is built in a temporary
folder and renamed into place, so a folder at `root` is always complete, even with several processes racing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

log = logging.getLogger(__name__)

SHAPE_CLASSES = ("circle", "square", "triangle", "star", "cross", "ring")
_SPLITS = {"train": 0, "val": 1}
_SUPERSAMPLE = 2  # draw at 2x and downsample, for anti-aliased edges


def _polygon(cx: float, cy: float, r: float, corners: int, angle: float, inner: float | None = None) -> list:
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
    arm = [(-w, -r), (w, -r), (w, -w), (r, -w), (r, w), (w, w), (w, r), (-w, r), (-w, w), (-r, w), (-r, -w), (-w, -w)]
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + x * c - y * s, cy + x * s + y * c) for x, y in arm]


def _background(rng: np.random.Generator, size: int) -> Image.Image:
    """Smooth colour gradient + stripes + noise, so the class is never readable from the background."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    c0, c1 = rng.uniform(0, 120, 3), rng.uniform(0, 120, 3)  # darker than any shape
    t = (xx * math.cos(rng.uniform(0, 2 * math.pi)) + yy * math.sin(rng.uniform(0, 2 * math.pi)) + 1) / 3
    img = c0 * (1 - t[..., None]) + c1 * t[..., None]
    freq, phase = rng.uniform(2, 8), rng.uniform(0, 2 * math.pi)
    stripes = np.sin(2 * math.pi * freq * (xx if rng.random() < 0.5 else yy) + phase)
    img += rng.uniform(0, 20) * stripes[..., None]
    img += rng.normal(0, rng.uniform(2, 8), img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def render_shape(label: int, rng: np.random.Generator, size: int) -> Image.Image:
    """One image of class `label`, fully determined by `rng`'s state."""
    big = size * _SUPERSAMPLE
    img = _background(rng, big)
    draw = ImageDraw.Draw(img)
    r = rng.uniform(0.28, 0.42) * big
    jitter = big / 2 - r  # the shape stays inside; its centre lies in the middle half of the free range
    cx, cy = big / 2 + jitter * rng.uniform(-1, 1) * 0.5, big / 2 + jitter * rng.uniform(-1, 1) * 0.5
    angle = rng.uniform(0, 2 * math.pi)
    colour = rng.uniform(60, 255, 3)
    colour[rng.integers(3)] = 255  # one saturated channel: always brighter than the background
    fill = tuple(int(c) for c in colour)
    name = SHAPE_CLASSES[label]
    if name == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif name == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=max(2, int(0.3 * r)))
    elif name == "square":
        draw.polygon(_polygon(cx, cy, r, 4, angle), fill=fill)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy, r, 3, angle), fill=fill)
    elif name == "star":
        draw.polygon(_polygon(cx, cy, r, 5, angle, inner=0.45), fill=fill)
    elif name == "cross":
        draw.polygon(_cross(cx, cy, r, angle), fill=fill)
    img = img.filter(ImageFilter.GaussianBlur(radius=rng.uniform(0, 1.0)))
    return img.resize((size, size), Image.Resampling.LANCZOS)


def _spec(synthetic) -> dict:
    return {
        "dataset": "shapes",
        "classes": list(SHAPE_CLASSES),
        "train_per_class": int(synthetic.train_per_class),
        "val_per_class": int(synthetic.val_per_class),
        "image_size": int(synthetic.image_size),
        "seed": int(synthetic.seed),
    }


def _write_split(tmp: Path, split: str, per_class: int, spec: dict, progress) -> None:
    for label, name in enumerate(SHAPE_CLASSES):
        (tmp / split / name).mkdir(parents=True)
    for n in progress(range(per_class * len(SHAPE_CLASSES)), f"generating shapes/{split}"):
        label = n % len(SHAPE_CLASSES)
        rng = np.random.default_rng([spec["seed"], _SPLITS[split], n])
        img = render_shape(label, rng, spec["image_size"])
        img.save(tmp / split / SHAPE_CLASSES[label] / f"{n:06d}.jpg", quality=92)


def _no_progress(items, _description):
    return items


def ensure_shapes(root: str | os.PathLike, synthetic, show_progress: bool = False) -> Path:
    """Generate the dataset at `root` unless a complete copy with the same spec is already there."""
    root = Path(root).expanduser()
    spec = _spec(synthetic)
    meta = root / "dataset.json"
    if meta.exists():
        found = json.loads(meta.read_text())
        if found != spec:
            raise ValueError(
                f"{root} holds a shapes dataset generated with {found}, not the requested {spec}: "
                "delete that folder or point data.root elsewhere"
            )
        return root
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"{root} exists and is not a generated shapes dataset: point data.root elsewhere")

    if show_progress:
        from rich.progress import track

        def progress(items, description):
            return track(items, description=description, transient=True)
    else:
        progress = _no_progress
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("generating the built-in shapes dataset in %s", root)
    _write_split(tmp, "train", spec["train_per_class"], spec, progress)
    _write_split(tmp, "val", spec["val_per_class"], spec, progress)
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
