"""A COCO annotation file read into image records (`read_records`), without torch: the dataset
(`coco.py`), the launcher's checks before any rank starts and the scorer read it alike.

Rules, each counted and logged when the dataset is built:
- boxes are COCO xywh, converted to xyxy, clipped to the image (those that reached 1 px or more past
  it counted, the first named); a box with width or height < 1 px after clipping is degenerate and
  dropped;
- crowd annotations are left out of training targets (COCOeval reads them from the annotation file
  itself);
- for training, images left without a usable box are dropped; evaluation keeps every image;
- an annotation whose image_id is not among `images` is left out (there is no image to put its box
  on);
- an annotation whose category is not in `categories` is an error naming the annotation;
- a `file_name` that is absolute or climbs out of the image folder (`..`) is refused;
- with `masks` (a model with a mask head) every kept annotation's `segmentation` (polygons or RLE)
  is kept; polygons a tool wrote as [x, y] points or unwrapped are read in COCO's form
  (`masks.coco_polygons`), counted. In training, an instance without a valid segmentation (none,
  an empty list, or only polygons of fewer than 3 points) is left out, box and all, as detectron2
  leaves it out: counted, and named in the log; a polygon of fewer than 3 points beside valid ones
  is dropped from its instance; a split that loses more than half its instances so is refused. In
  evaluation such an instance is refused, naming it (COCOeval scores every val instance's mask);
- annotation ids that are not positive and unique are numbered 1, 2, ... for scoring
  (`renumbering_line` says so).
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Optional

import numpy as np
from pycocotools.coco import COCO

from visiondist.data.masks import coco_polygons
from visiondist.utils.text import counted


@dataclass
class CocoCounts:
    """What loading the annotations left out (all of it is also in the log)."""

    images: int = 0
    boxes: int = 0
    crowd_boxes: int = 0
    degenerate_boxes: int = 0
    images_without_boxes: int = 0
    orphan_annotations: int = 0  # image_id not among `images`
    without_mask: int = 0  # mask training: instances without a valid segmentation
    without_mask_ids: list = field(default_factory=list)  # their annotation ids (the first `NAMED`)
    # kept, clipped to their image: boxes that reached 1 px or more past it
    clipped_boxes: int = 0
    clipped_first: str = ""  # the first one, for a message: "annotation 5 of image 3, ..."
    # kept: polygons written as [x, y] points or as one unwrapped list, read as COCO's form
    reshaped: int = 0
    reshaped_first: str = ""  # "annotation 4, [[10, 10], [20, 10], ...] (points)"

    NAMED = 10

    def describe(self) -> str:
        masks = (
            f", {counted(self.without_mask, 'instances')} without a valid segmentation "
            f"({self.named_without_mask()})"
            if self.without_mask
            else ""
        )
        clipped = f" ({self.clipped_boxes} clipped to their image)" if self.clipped_boxes else ""
        return (
            f"{counted(self.images, 'images')}, {counted(self.boxes, 'boxes')}{clipped}; left out: "
            f"{counted(self.crowd_boxes, 'crowd boxes')}, "
            f"{counted(self.degenerate_boxes, 'degenerate boxes')}, "
            f"{counted(self.images_without_boxes, 'images without usable boxes')}, "
            f"{counted(self.orphan_annotations, 'annotations whose image_id has no image')}{masks}"
        )

    def clipped(self, ann: dict, image_id: int, width: int, height: int) -> None:
        """Count a kept box that reached past its image, naming the first."""
        self.clipped_boxes += 1
        box = [round(float(v), 1) for v in ann["bbox"]]
        self.clipped_first = self.clipped_first or (
            f"annotation {ann.get('id')} of image {image_id}, {box} on {width} x {height}"
        )

    def named_without_mask(self) -> str:
        more = self.without_mask - len(self.without_mask_ids)
        ids = ", ".join(map(str, self.without_mask_ids))
        return (
            f"annotation id{'s' if self.without_mask > 1 else ''} "
            f"{ids}{f' and {more} more' if more else ''}: empty, or polygons of fewer than 3 "
            "points"
        )


@dataclass
class ImageRecord:
    image_id: int
    path: Path
    width: int
    height: int
    boxes: np.ndarray  # (n, 4) float32 xyxy, clipped
    labels: np.ndarray  # (n,) int64, contiguous 1..K (0 is the background)
    segmentations: Optional[list] = None  # with masks: the n annotations' COCO segmentations


def safe_image_path(root: Path, file_name: str) -> Path:
    """`root / file_name`, refusing names that are absolute or climb out of `root`."""
    name = PurePosixPath(file_name.replace("\\", "/"))
    if name.is_absolute() or ".." in name.parts or not name.parts:
        raise ValueError(
            f"image file_name {file_name!r} escapes the image folder {root}: refusing to read it"
        )
    return root.joinpath(*name.parts)


def renumbering_line(ann_file: str | Path, annotations: list[dict]) -> Optional[str]:
    """What scoring does to a val file's annotation ids that are not positive and unique (Label
    Studio's and other tools' exports count from 0; COCOeval reads id 0 as unmatched): it numbers
    them 1, 2, ...; None when they are."""
    ids = [a.get("id") for a in annotations]
    if all(isinstance(i, int) and i > 0 for i in ids) and len(set(ids)) == len(ids):
        return None
    n = len(annotations)
    why = "repeat" if len(set(ids)) != n else "are not all positive whole numbers"
    return (
        f"{ann_file}: its {n} annotation ids scored as 1-{n} (they {why}; COCO's scoring reads "
        "id 0 as unmatched)"
    )


def load_coco(ann_file: Path, quiet: bool = True):
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        return COCO(str(ann_file))


def read_records(
    coco, image_root: Path, train: bool, masks: bool = False
) -> tuple[list[ImageRecord], dict[int, int], CocoCounts]:
    """Image records with their usable boxes (and, with `masks`, their segmentations), the category
    id -> label map, and the counts of what was left out."""
    cat_ids = sorted(coco.getCatIds())
    label_of = {cat: i + 1 for i, cat in enumerate(cat_ids)}
    counts = CocoCounts()
    counts.orphan_annotations = sum(
        len(anns) for image_id, anns in coco.imgToAnns.items() if image_id not in coco.imgs
    )
    records = []
    for image_id in sorted(coco.getImgIds()):
        info = coco.imgs[image_id]
        width, height = int(info["width"]), int(info["height"])
        path = safe_image_path(image_root, info["file_name"])
        boxes, labels, segmentations = [], [], []
        for ann in coco.imgToAnns.get(image_id, []):
            if ann["category_id"] not in label_of:
                raise ValueError(
                    f"annotation {ann.get('id')} (image {image_id}) has category_id "
                    f"{ann['category_id']}, which is not among the categories of "
                    f"{coco.dataset.get('_file', 'the annotation file')}: "
                    f"{cat_ids[:10]}{'...' if len(cat_ids) > 10 else ''}"
                )
            if ann.get("iscrowd", 0):
                counts.crowd_boxes += 1
                continue
            box, past = _clipped(ann, width, height)
            if box[2] - box[0] < 1 or box[3] - box[1] < 1:
                counts.degenerate_boxes += 1
                continue
            if past:
                counts.clipped(ann, image_id, width, height)
            segmentation = _segmentation(ann, counts) if masks else None
            if masks and segmentation is None and not train:
                raise ValueError(
                    f"annotation {ann.get('id')} (image {image_id}) of "
                    f"{coco.dataset.get('_file', 'the annotation file')} has no valid segmentation "
                    f"({_shown(ann.get('segmentation'))}: empty, or polygons of fewer than 3 "
                    "points), and a mask model is scored on every val instance's mask: fix its "
                    "polygon or remove the annotation"
                )
            if masks and segmentation is None:
                counts.without_mask += 1
                if len(counts.without_mask_ids) < counts.NAMED:
                    counts.without_mask_ids.append(ann.get("id"))
                continue
            boxes.append(box)
            labels.append(label_of[ann["category_id"]])
            if masks:
                segmentations.append(segmentation)
        if train and not boxes:
            counts.images_without_boxes += 1
            continue
        records.append(
            ImageRecord(
                image_id,
                path,
                width,
                height,
                np.asarray(boxes, dtype=np.float32).reshape(-1, 4),
                np.asarray(labels, dtype=np.int64),
                segmentations if masks else None,
            )
        )
        counts.boxes += len(boxes)
    counts.images = len(records)
    if masks and counts.without_mask > counts.boxes:
        raise ValueError(
            f"{coco.dataset.get('_file', 'the annotation file')}: {counts.without_mask} of its "
            f"{counts.without_mask + counts.boxes} instances have no valid segmentation "
            f"({counts.named_without_mask()}), which a model with a mask head trains on: fix "
            "their segmentations, or train a model without masks (fasterrcnn_* for maskrcnn_*, "
            "model.masks=false for ViTDet)"
        )
    return records, label_of, counts


def _shown(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...]"


def _clipped(ann: dict, width: int, height: int) -> tuple[list[float], bool]:
    """The annotation's xywh box as xyxy clipped to its image, and whether it reached 1 px or more
    past it (rounding aside)."""
    x, y, w, h = ann["bbox"]
    past = min(x, y) <= -1 or x + w >= width + 1 or y + h >= height + 1
    x1, y1 = min(max(x, 0.0), width), min(max(y, 0.0), height)
    return [x1, y1, min(max(x + w, 0.0), width), min(max(y + h, 0.0), height)], past


def _segmentation(ann: dict, counts: CocoCounts) -> Any:
    """The annotation's segmentation as a mask model trains on it: an RLE as it is, polygons of at
    least 3 points (6 coordinates, an even count), in COCO's form where a tool wrote them as points
    or unwrapped (`masks.coco_polygons`; counted); None when nothing valid is left (detectron2's
    rule)."""
    segmentation = ann.get("segmentation")
    if isinstance(segmentation, dict):
        return segmentation if segmentation.get("counts") else None
    if not isinstance(segmentation, list):
        return None
    written, form = coco_polygons(segmentation)
    polygons = [p for p in written if isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0]
    if polygons and form != "coco":
        counts.reshaped += 1
        counts.reshaped_first = counts.reshaped_first or (
            f"annotation {ann.get('id')}, {_shown(segmentation)} ({form})"
        )
    return polygons or None
