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
import socket
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


def _bright_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    colour = rng.uniform(60, 255, 3)
    colour[rng.integers(3)] = 255  # one saturated channel: always brighter than the background
    return tuple(int(c) for c in colour)


def draw_shape(draw: ImageDraw.ImageDraw, name: str, cx: float, cy: float, r: float, rng: np.random.Generator) -> list:
    """Draw one shape of radius `r` centred at (cx, cy) in a random bright colour and angle; return its outline
    points (for the tight box)."""
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


def render_shape(label: int, rng: np.random.Generator, size: int) -> Image.Image:
    """One image of class `label`, fully determined by `rng`'s state."""
    big = size * _SUPERSAMPLE
    img = _background(rng, big)
    draw = ImageDraw.Draw(img)
    r = rng.uniform(0.28, 0.42) * big
    jitter = big / 2 - r  # the shape stays inside; its centre lies in the middle half of the free range
    cx, cy = big / 2 + jitter * rng.uniform(-1, 1) * 0.5, big / 2 + jitter * rng.uniform(-1, 1) * 0.5
    draw_shape(draw, SHAPE_CLASSES[label], cx, cy, r, rng)
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


def _tracker(show_progress: bool):
    if not show_progress:
        return _no_progress
    from rich.progress import track

    def progress(items, description):
        return track(items, description=description, transient=True)

    return progress


def _ensure(root: str | os.PathLike, spec: dict, write, show_progress: bool) -> Path:
    """Build a dataset with `write(tmp_dir, progress)` unless a complete copy with the same spec is at `root`. Written
    to a temporary folder and renamed into place, so a folder at `root` is always complete."""
    root = Path(root).expanduser()
    meta = root / "dataset.json"
    if meta.exists():
        found = json.loads(meta.read_text())
        if found != spec:
            raise ValueError(
                f"{root} holds a {found.get('dataset')} dataset generated with {found}, not the requested {spec}: "
                "delete that folder or point data.root elsewhere"
            )
        return root
    if root.exists() and any(root.iterdir()):
        raise ValueError(f"{root} exists and is not a generated {spec['dataset']} dataset: point data.root elsewhere")

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
    """Generate the classification set at `root` unless a complete copy with the same spec is already there."""
    spec = _spec(synthetic)

    def write(tmp: Path, progress) -> None:
        _write_split(tmp, "train", spec["train_per_class"], spec, progress)
        _write_split(tmp, "val", spec["val_per_class"], spec, progress)

    return _ensure(root, spec, write, show_progress)


# ----------------------------------------------------------------------------------------------------------------
# shapes_coco: several shapes per image, boxes in a COCO instances file.

_ASPECTS = ((1.0, 1.0), (1.0, 0.75), (0.75, 1.0))  # (width, height) factors: landscape and portrait images too


def _iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def render_scene(rng: np.random.Generator, size: int, max_objects: int = 4) -> tuple[Image.Image, list]:
    """An image with 0..max_objects shapes (about 1 in 12 empty) of varied sizes, overlapping a little at most;
    returns the image and [(class index, [x1, y1, x2, y2])] in pixels."""
    fw, fh = _ASPECTS[rng.integers(len(_ASPECTS))]
    w, h = int(size * fw), int(size * fh)
    big_w, big_h = w * _SUPERSAMPLE, h * _SUPERSAMPLE
    img = _background(rng, max(big_w, big_h)).crop((0, 0, big_w, big_h))
    draw = ImageDraw.Draw(img)
    count = 0 if rng.random() < 1 / 12 else int(rng.integers(1, max_objects + 1))
    objects: list = []
    for _ in range(count):
        for _attempt in range(10):  # place it where it overlaps earlier shapes by IoU <= 0.3
            r = rng.uniform(0.09, 0.26) * min(big_w, big_h)
            cx, cy = rng.uniform(0.6 * r, big_w - 0.6 * r), rng.uniform(0.6 * r, big_h - 0.6 * r)
            guess = [cx - r, cy - r, cx + r, cy + r]
            if all(_iou(guess, [c * _SUPERSAMPLE for c in box]) <= 0.3 for _, box in objects):
                break
        else:
            continue
        label = int(rng.integers(len(SHAPE_CLASSES)))
        points = np.array(draw_shape(draw, SHAPE_CLASSES[label], cx, cy, r, rng))
        x1, y1 = np.clip(points.min(0), 0, [big_w, big_h]) / _SUPERSAMPLE
        x2, y2 = np.clip(points.max(0), 0, [big_w, big_h]) / _SUPERSAMPLE
        objects.append((label, [float(x1), float(y1), float(x2), float(y2)]))
    img = img.filter(ImageFilter.GaussianBlur(radius=rng.uniform(0, 1.0)))
    return img.resize((w, h), Image.Resampling.LANCZOS), objects


def _coco_spec(synthetic) -> dict:
    return {
        "dataset": "shapes_coco",
        "classes": list(SHAPE_CLASSES),
        "train_images": int(synthetic.train_images),
        "val_images": int(synthetic.val_images),
        "image_size": int(synthetic.image_size),
        "seed": int(synthetic.seed),
    }


def _write_coco_split(tmp: Path, split: str, count: int, spec: dict, progress) -> None:
    (tmp / split).mkdir(parents=True)
    (tmp / "annotations").mkdir(exist_ok=True)
    images, annotations = [], []
    for n in progress(range(count), f"generating shapes_coco/{split}"):
        rng = np.random.default_rng([spec["seed"], 10 + _SPLITS[split], n])
        img, objects = render_scene(rng, spec["image_size"])
        name = f"{n:06d}.jpg"
        img.save(tmp / split / name, quality=92)
        images.append({"id": n + 1, "file_name": name, "width": img.width, "height": img.height})
        for label, (x1, y1, x2, y2) in objects:
            w, h = round(x2 - x1, 2), round(y2 - y1, 2)
            annotations.append({
                "id": len(annotations) + 1, "image_id": n + 1, "category_id": label + 1,
                "bbox": [round(x1, 2), round(y1, 2), w, h], "area": round(w * h, 2), "iscrowd": 0,
            })
    categories = [{"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(SHAPE_CLASSES)]
    coco = {"info": {"description": "visiondist built-in shapes_coco"}, "images": images,
            "annotations": annotations, "categories": categories}
    (tmp / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))


def ensure_shapes_coco(root: str | os.PathLike, synthetic, show_progress: bool = False) -> Path:
    """Generate the detection set at `root` (`<split>/*.jpg` + `annotations/instances_<split>.json`, COCO format)
    unless a complete copy with the same spec is already there."""
    spec = _coco_spec(synthetic)

    def write(tmp: Path, progress) -> None:
        _write_coco_split(tmp, "train", spec["train_images"], spec, progress)
        _write_coco_split(tmp, "val", spec["val_images"], spec, progress)

    return _ensure(root, spec, write, show_progress)
