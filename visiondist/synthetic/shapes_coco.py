"""The built-in `shapes_coco` set: several shapes per image on the textured backgrounds of `shapes`,
with boxes and instance masks in a COCO instances file (`<root>/<split>/*.jpg`,
`<root>/annotations/instances_<split>.json`), read by the same loader as COCO itself.

Masks are what the image shows: a shape's polygon (circles as 32-gons), a ring's annulus as an RLE,
and, where a later shape covers part of an earlier one, the visible part as an RLE. About 1 image in
6 also holds a crowd region (a cluster of small shapes of one class, `iscrowd: 1`, an uncompressed
RLE as COCO's crowds are), drawn under the other shapes from a stream of its own, so the other
shapes, their boxes and their places are those of version 1 (boxes only). An annotation's `area` is
its mask's pixel count, as in COCO.

Generation is deterministic: image n of a split depends only on (seed, split, n).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from visiondist.data import masks as masks_lib
from visiondist.synthetic.shapes import (
    SHAPE_CLASSES,
    SPLITS,
    SUPERSAMPLE,
    background,
    draw_shape,
    ensure,
)

VERSION = 2  # 1: boxes only; 2: masks and crowd regions
# (width, height) factors: landscape and portrait images too
_ASPECTS = ((1.0, 1.0), (1.0, 0.75), (0.75, 1.0))
CROWD_SHARE = 1 / 6


def _iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _segmentation(name: str, points: np.ndarray, cx: float, cy: float, r: float, h: int, w: int):
    """The shape's full mask as COCO writes it, in the output image's pixels: polygons for polygons
    and circles (a 32-gon), a compressed RLE for a ring (an annulus as `draw_shape` draws it)."""
    s = 1 / SUPERSAMPLE
    if name == "ring":
        width = max(2, int(0.3 * r))
        yy, xx = np.mgrid[0:h, 0:w]
        d = np.hypot(xx + 0.5 - cx * s, yy + 0.5 - cy * s)
        return masks_lib.encode(((d <= r * s) & (d >= (r - width) * s))[None])[0]
    if name == "circle":
        points = np.array(
            [
                (cx + r * math.cos(a), cy + r * math.sin(a))
                for a in np.linspace(0, 2 * math.pi, 32, endpoint=False)
            ]
        )
    return [[round(float(v), 2) for v in (points * s).reshape(-1)]]


def _crowd(
    draw: ImageDraw.ImageDraw, rng: np.random.Generator, big_w: int, big_h: int, h: int, w: int
):
    """A cluster of 5-9 small shapes of one class (circles or squares) drawn with `rng`; (class
    index, mask)."""
    label = int(rng.integers(2))  # circle or square
    side = min(big_w, big_h)
    span = rng.uniform(0.25, 0.4) * side
    x0, y0 = rng.uniform(0, big_w - span), rng.uniform(0, big_h - span)
    parts = []
    for _ in range(int(rng.integers(5, 10))):
        r = rng.uniform(0.025, 0.045) * side
        cx, cy = x0 + rng.uniform(r, span - r), y0 + rng.uniform(r, span - r)
        points = np.array(draw_shape(draw, SHAPE_CLASSES[label], cx, cy, r, rng))
        parts.append(_segmentation(SHAPE_CLASSES[label], points, cx, cy, r, h, w))
    mask = np.any(np.stack([masks_lib.decode([p], h, w)[0] for p in parts]), axis=0)
    return label, mask


def render_scene(
    rng: np.random.Generator,
    size: int,
    max_objects: int = 4,
    crowd_rng: np.random.Generator | None = None,
) -> tuple[Image.Image, list, list]:
    """An image with 0..max_objects shapes (about 1 in 12 empty) of varied sizes, overlapping a
    little at most, and, drawn first with `crowd_rng` in about 1 image of 6, a crowd region. Returns
    the image, [(class index, [x1, y1, x2, y2], full segmentation)] of the shapes in drawing order,
    and [(class index, mask)] of the crowd regions."""
    fw, fh = _ASPECTS[rng.integers(len(_ASPECTS))]
    w, h = int(size * fw), int(size * fh)
    big_w, big_h = w * SUPERSAMPLE, h * SUPERSAMPLE
    img = background(rng, max(big_w, big_h)).crop((0, 0, big_w, big_h))
    draw = ImageDraw.Draw(img)
    crowds = []
    if crowd_rng is not None and crowd_rng.random() < CROWD_SHARE:
        crowds.append(_crowd(draw, crowd_rng, big_w, big_h, h, w))
    count = 0 if rng.random() < 1 / 12 else int(rng.integers(1, max_objects + 1))
    objects: list = []
    for _ in range(count):
        for _attempt in range(10):  # place it where it overlaps earlier shapes by IoU <= 0.3
            r = rng.uniform(0.09, 0.26) * min(big_w, big_h)
            cx, cy = rng.uniform(0.6 * r, big_w - 0.6 * r), rng.uniform(0.6 * r, big_h - 0.6 * r)
            guess = [cx - r, cy - r, cx + r, cy + r]
            if all(_iou(guess, [c * SUPERSAMPLE for c in box]) <= 0.3 for _, box, _ in objects):
                break
        else:
            continue
        label = int(rng.integers(len(SHAPE_CLASSES)))
        points = np.array(draw_shape(draw, SHAPE_CLASSES[label], cx, cy, r, rng))
        x1, y1 = np.clip(points.min(0), 0, [big_w, big_h]) / SUPERSAMPLE
        x2, y2 = np.clip(points.max(0), 0, [big_w, big_h]) / SUPERSAMPLE
        segmentation = _segmentation(SHAPE_CLASSES[label], points, cx, cy, r, h, w)
        objects.append((label, [float(x1), float(y1), float(x2), float(y2)], segmentation))
    img = img.filter(ImageFilter.GaussianBlur(radius=rng.uniform(0, 1.0)))
    return img.resize((w, h), Image.Resampling.LANCZOS), objects, crowds


def _uncompressed_rle(mask: np.ndarray) -> dict:
    """COCO's crowd format: run lengths of the column-major mask, starting with a run of zeros."""
    flat = np.asarray(mask, dtype=np.uint8).reshape(-1, order="F")
    changes = np.flatnonzero(np.diff(flat)) + 1
    runs = np.diff(np.concatenate([[0], changes, [flat.size]]))
    counts = ([0] if flat.size and flat[0] else []) + runs.tolist()
    return {"size": [int(mask.shape[0]), int(mask.shape[1])], "counts": [int(c) for c in counts]}


def scene_annotations(objects: list, crowds: list, h: int, w: int) -> list[dict]:
    """The annotations of one image (without ids): each shape's visible mask (its full segmentation
    where nothing covers it), then the crowd regions less whatever is drawn over them."""
    full = [masks_lib.decode([seg], h, w)[0].astype(bool) for _, _, seg in objects]
    out = []
    for i, (label, (x1, y1, x2, y2), segmentation) in enumerate(objects):
        covered = np.any(np.stack(full[i + 1 :]), axis=0) & full[i] if i + 1 < len(full) else None
        if covered is not None and covered.any() and (full[i] & ~covered).any():
            segmentation = masks_lib.encode((full[i] & ~covered)[None])[0]
        bw, bh = round(x2 - x1, 2), round(y2 - y1, 2)
        out.append(
            {
                "category_id": label + 1,
                "bbox": [round(x1, 2), round(y1, 2), bw, bh],
                "segmentation": segmentation,
                "area": masks_lib.area(segmentation, h, w),
                "iscrowd": 0,
            }
        )
    above = np.any(np.stack(full), axis=0) if full else np.zeros((h, w), dtype=bool)
    for label, mask in crowds:
        visible = mask & ~above
        if not visible.any():
            continue
        ys, xs = np.nonzero(visible)
        x1, y1, x2, y2 = float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)
        out.append(
            {
                "category_id": label + 1,
                "bbox": [x1, y1, x2 - x1, y2 - y1],
                "segmentation": _uncompressed_rle(visible),
                "area": float(visible.sum()),
                "iscrowd": 1,
            }
        )
    return out


def spec_of_shapes_coco(synthetic) -> dict:
    """What a `shapes_coco` copy is made of: the dataset.json a generated copy holds.

    Args:
        synthetic: the data config's `synthetic` group (images per split, size, seed).

    Returns:
        The spec, which a copy at `data.root` must match.
    """
    return {
        "dataset": "shapes_coco",
        "version": VERSION,
        "classes": list(SHAPE_CLASSES),
        "train_images": int(synthetic.train_images),
        "val_images": int(synthetic.val_images),
        "image_size": int(synthetic.image_size),
        "seed": int(synthetic.seed),
    }


def _write_coco_split(tmp: Path, split: str, count: int, spec: dict, progress) -> None:
    (tmp / split).mkdir(parents=True)
    (tmp / "annotations").mkdir(exist_ok=True)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for n in progress(range(count), f"generating shapes_coco/{split}"):
        rng = np.random.default_rng([spec["seed"], 10 + SPLITS[split], n])
        crowd_rng = np.random.default_rng([spec["seed"], 20 + SPLITS[split], n])
        img, objects, crowds = render_scene(rng, spec["image_size"], crowd_rng=crowd_rng)
        name = f"{n:06d}.jpg"
        img.save(tmp / split / name, quality=92)
        images.append({"id": n + 1, "file_name": name, "width": img.width, "height": img.height})
        for ann in scene_annotations(objects, crowds, img.height, img.width):
            annotations.append({"id": len(annotations) + 1, "image_id": n + 1, **ann})
    categories = [
        {"id": i + 1, "name": name, "supercategory": "shape"}
        for i, name in enumerate(SHAPE_CLASSES)
    ]
    coco = {
        "info": {"description": "visiondist built-in shapes_coco"},
        "images": images,
        "annotations": annotations,
        "categories": categories,
    }
    (tmp / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))


def ensure_shapes_coco(root: str | os.PathLike, synthetic, show_progress: bool = False) -> Path:
    """Generate the detection set at `root` unless a complete copy with the same spec is there.

    `<split>/*.jpg` + `annotations/instances_<split>.json`, COCO format; an earlier version's copy
    is generated again.

    Args:
        root: the set's folder (`data.root`).
        synthetic: the data config's `synthetic` group.
        show_progress: a progress bar while the images are written.

    Returns:
        `root`, holding the set.
    """
    spec = spec_of_shapes_coco(synthetic)

    def write(tmp: Path, progress) -> None:
        _write_coco_split(tmp, "train", spec["train_images"], spec, progress)
        _write_coco_split(tmp, "val", spec["val_images"], spec, progress)

    return ensure(root, spec, write, show_progress)
