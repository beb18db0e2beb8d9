"""Instance masks: COCO's polygons and RLEs through pycocotools' mask API, decoded only for the
images a loader reads.

An annotation's `segmentation` is a list of polygons (`[[x1, y1, x2, y2, ...], ...]`, in pixels), an
uncompressed RLE (`{"size": [h, w], "counts": [run lengths]}`, COCO's crowd regions) or a compressed
one (`counts` a string). The loader keeps every kept annotation's segmentation as its JSON text in
one byte buffer with offsets (`SegmentationIndex`: no Python object per annotation, shared by forked
loader workers) and turns those of one image into masks when that image is read (`decode`).
Predicted masks go the other way (`encode`) for COCOeval's `segm`.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
from pycocotools import mask as mask_utils


def to_rle(segmentation: Any, height: int, width: int) -> dict:
    """One compressed RLE of an annotation's segmentation (polygons merged into one mask), as
    COCOeval reads it."""
    if isinstance(segmentation, list):  # polygons: one object may have several parts
        polygons = [p for p in segmentation if len(p) >= 6]  # fewer than 3 points covers nothing
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
