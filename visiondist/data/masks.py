"""Instance masks: COCO's polygons and RLEs through pycocotools' mask API, decoded only for the
images a loader reads.

An annotation's `segmentation` is a list of polygons (`[[x1, y1, x2, y2, ...], ...]`, in pixels), an
uncompressed RLE (`{"size": [h, w], "counts": [run lengths]}`, COCO's crowd regions) or a compressed
one (`counts` a string). The loader keeps every kept annotation's segmentation as its JSON text in
one byte buffer with offsets (`SegmentationIndex`: no Python object per annotation, shared by forked
loader workers) and turns those of one image into masks when that image is read (`decode`).
Predicted masks go the other way (`encode`) for COCOeval's `segm`.

Annotation tools and home-made converters also write a polygon as `[x, y]` points (labelme's form,
`[[x1, y1], [x2, y2], ...]`) or as one flat list not wrapped in the outer list (`[x1, y1, ...]`):
`coco_polygons` reads both as COCO's form, for training and for scoring alike.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
from pycocotools import mask as mask_utils


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _point(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 2 and all(map(_number, v))


def coco_polygons(segmentation: list) -> tuple[list, str]:
    """A polygon segmentation in COCO's form (`[[x1, y1, x2, y2, ...], ...]`), and the form it was
    written in: "coco"; "points" for `[x, y]` pairs (`[[x1, y1], [x2, y2], ...]`, or a list of such
    polygons); "flat" for one polygon not wrapped in the outer list (`[x1, y1, x2, y2, ...]`).
    Anything else is returned as it is ("coco"), for the validity rules to judge."""
    if segmentation and all(map(_number, segmentation)):
        return [list(segmentation)], "flat"
    if segmentation and all(map(_point, segmentation)):
        return [[c for point in segmentation for c in point]], "points"
    polygons, form = [], "coco"
    for part in segmentation:
        if isinstance(part, list) and part and all(map(_point, part)):
            polygons.append([c for point in part for c in point])
            form = "points"
        else:
            polygons.append(part)
    return polygons, form


def to_rle(segmentation: Any, height: int, width: int) -> dict:
    """One compressed RLE of an annotation's segmentation (polygons merged into one mask), as
    COCOeval reads it."""
    if isinstance(segmentation, list):  # polygons: one object may have several parts
        # fewer than 3 points covers nothing
        polygons = [p for p in coco_polygons(segmentation)[0] if len(p) >= 6]
        if not polygons:
            return mask_utils.encode(np.zeros((height, width, 1), dtype=np.uint8, order="F"))[0]
        return mask_utils.merge(mask_utils.frPyObjects(polygons, height, width))
    if isinstance(segmentation.get("counts"), list):  # uncompressed (crowd regions)
        return mask_utils.frPyObjects(segmentation, height, width)
    counts = segmentation["counts"]
    return {
        "size": list(segmentation["size"]),
        "counts": counts.encode() if isinstance(counts, str) else counts,
    }


def decode(segmentations: Sequence[Any], height: int, width: int) -> np.ndarray:
    """(n, height, width) uint8 masks (0 / 1) of `segmentations`."""
    if not segmentations:
        return np.zeros((0, height, width), dtype=np.uint8)
    rles = [to_rle(s, height, width) for s in segmentations]
    return np.ascontiguousarray(mask_utils.decode(rles).transpose(2, 0, 1))


def encode(masks: np.ndarray) -> list[dict]:
    """Compressed RLEs (JSON-ready: `counts` as text) of (n, height, width) binary masks."""
    if len(masks) == 0:
        return []
    rles = mask_utils.encode(
        np.asfortranarray(np.asarray(masks, dtype=np.uint8).transpose(1, 2, 0))
    )
    return [{"size": [int(v) for v in r["size"]], "counts": r["counts"].decode()} for r in rles]


def area(segmentation: Any, height: int, width: int) -> float:
    """Pixels covered, as COCO's annotation `area` counts them for masks."""
    return float(mask_utils.area(to_rle(segmentation, height, width)))


class SegmentationIndex:
    """Segmentations in annotation order as JSON text in one uint8 buffer (`get(a, b)`: those of
    annotations a..b-1)."""

    def __init__(self, segmentations: Sequence[Any]):
        texts = [json.dumps(s, separators=(",", ":")).encode() for s in segmentations]
        self.offsets = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum([len(t) for t in texts], out=self.offsets[1:])
        self.buffer = (
            np.frombuffer(b"".join(texts), dtype=np.uint8) if texts else np.zeros(0, dtype=np.uint8)
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, a: int, b: int) -> list[Any]:
        return [
            json.loads(self.buffer[self.offsets[i] : self.offsets[i + 1]].tobytes())
            for i in range(a, b)
        ]

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes + self.offsets.nbytes
