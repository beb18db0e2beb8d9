"""COCO-format detection data (real COCO and the built-in `shapes_coco` go through this same code).

Rules, each counted and logged when the dataset is built:
- boxes are COCO xywh, converted to xyxy, clipped to the image; a box with width or height < 1 px
  after clipping is degenerate and dropped;
- crowd annotations are left out of training targets (COCOeval reads them from the annotation file
  itself);
- for training, images left without a usable box are dropped; evaluation keeps every image;
- an annotation whose image_id is not among `images` is left out (there is no image to put its box
  on);
- an annotation whose category is not in `categories` is an error naming the annotation;
- a `file_name` that is absolute or climbs out of the image folder (`..`) is refused;
- images are decoded by `visiondist.data.decode.read_rgb`, as in classification: upright (EXIF
  orientation applied), 16-bit scaled to 8, grey / CMYK / palette / RGBA converted to RGB; an image
  whose decoded size differs from the annotation file's width / height is an error naming the file
  (its boxes would not fit it), in training too;
- a training image that cannot be read is logged (once per file) and replaced by the next readable
  index; a run of `max_bad_images` consecutive unreadable images is an error. In evaluation an
  unreadable image is an error;
- with `masks` (a model with a mask head) every kept annotation's `segmentation` (polygons or RLE)
  is kept as text (`visiondist.data.masks.SegmentationIndex`) and decoded to masks at the image's
  size when the image is read. In training, an instance without a valid segmentation (none, an empty
  list, or only polygons of fewer than 3 points) is left out, box and all, as detectron2 leaves it
  out: counted, and named in the log; a polygon of fewer than 3 points beside valid ones is dropped
  from its instance.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Optional

import numpy as np
import torch
from pycocotools.coco import COCO
from torch.utils.data import Dataset

from visiondist.data.decode import exif_orientation, read_rgb
from visiondist.data.index import PathIndex
from visiondist.data.masks import SegmentationIndex, coco_polygons, decode
from visiondist.data.robust import BadImages
from visiondist.utils.text import counted

log = logging.getLogger(__name__)


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
            f", {self.without_mask} instances without a valid segmentation "
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
                    "points), and a mask model is scored on every val instance's mask: fix or "
                    "remove it, or mark it iscrowd=1"
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


class CocoIndex:
    """The records of a split in arrays (no Python object per image or box, so forked loader workers
    share the parent's pages instead of copying them): image ids and sizes, paths (`PathIndex`), and
    every image's boxes and labels as one slice of the concatenated `boxes` / `labels` (and, with
    masks, of `segmentations`)."""

    def __init__(self, records: list[ImageRecord], image_root: Path):
        root = str(image_root)
        self.image_ids = np.asarray([r.image_id for r in records], dtype=np.int64)
        self.sizes = np.asarray([(r.width, r.height) for r in records], dtype=np.int32).reshape(
            -1, 2
        )
        self.paths = PathIndex(root, [str(r.path.relative_to(root)) for r in records])
        counts = [len(r.boxes) for r in records]
        self.offsets = np.zeros(len(records) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.offsets[1:])
        self.boxes = (
            np.concatenate([r.boxes for r in records]) if records else np.zeros((0, 4))
        ).astype(np.float32)
        self.labels = (
            np.concatenate([r.labels for r in records]) if records else np.zeros(0)
        ).astype(np.int64)
        with_masks = bool(records) and records[0].segmentations is not None
        self.segmentations = (
            SegmentationIndex([s for r in records for s in r.segmentations or ()])
            if with_masks
            else None
        )

    def __len__(self) -> int:
        return len(self.image_ids)

    def record(self, i: int) -> ImageRecord:
        a, b = self.offsets[i], self.offsets[i + 1]
        return ImageRecord(
            int(self.image_ids[i]),
            Path(self.paths[i]),
            int(self.sizes[i, 0]),
            int(self.sizes[i, 1]),
            self.boxes[a:b],
            self.labels[a:b],
            self.segmentations.get(a, b) if self.segmentations is not None else None,
        )


class ImageSizeMismatch(RuntimeError):
    """A decoded image whose size is not the annotation file's: its boxes would be misplaced. Not a
    read error, so training stops on it rather than replacing the image."""


class CocoDetection(Dataset):
    """Items are (image tensor uint8 CHW, target dict) for torchvision detectors (`unit_float` makes
    the image float in [0, 1] on the device); indexed by int or by a sampler's (index, epoch) key.
    `transform(image, boxes, labels, index, epoch)` returns the three, augmented; with `masks`,
    `transform(..., masks=)` the four, and the target has "masks" (n, H, W) uint8 at the (augmented)
    image's size."""

    def __init__(
        self,
        image_root: str | Path,
        ann_file: str | Path,
        train: bool,
        transform: Optional[Callable] = None,
        max_bad_images: int = 10,
        masks: bool = False,
    ):
        self.image_root, self.ann_file, self.train = Path(image_root), Path(ann_file), train
        if not self.ann_file.is_file():
            raise FileNotFoundError(
                f"no COCO annotation file at {self.ann_file}: check data.root and data.annotations"
            )
        # not kept: the workers need only the index (and COCOeval reads the file)
        coco = load_coco(self.ann_file)
        coco.dataset["_file"] = str(self.ann_file)
        self.masks = masks
        records, self.label_of, self.counts = read_records(coco, self.image_root, train, masks)
        self.index = CocoIndex(records, self.image_root)
        self.cat_of = {label: cat for cat, label in self.label_of.items()}
        self.classes = [coco.cats[cat]["name"] for cat in sorted(self.label_of)]
        del coco, records
        self.transform = transform
        self._bad = BadImages(max_bad_images, train)
        log.info(
            "%s, by %s rules: %s",
            self.ann_file.name,
            "training's" if train else "evaluation's",
            self.counts.describe(),
        )

    def __len__(self) -> int:
        return len(self.index)

    @property
    def paths(self):
        """The images' paths by index (`PathIndex`), as `ImageFolder.paths`."""
        return self.index.paths

    @property
    def records(self) -> list[ImageRecord]:
        """Every image's record, as a list built on each call (the index itself is `index`)."""
        return [self.index.record(i) for i in range(len(self.index))]

    def image_sizes(self) -> np.ndarray:
        """Each image's (width, height), as the annotation file gives them."""
        return self.index.sizes

    def aspect_ratios(self) -> np.ndarray:
        return (self.index.sizes[:, 0] / self.index.sizes[:, 1]).astype(np.float32)

    def __getitem__(self, key: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        index, image = self._load(index)
        record = self.index.record(index)
        boxes, labels = record.boxes, record.labels
        masks = (
            decode(record.segmentations or [], record.height, record.width) if self.masks else None
        )
        if self.transform is not None and masks is not None:
            image, boxes, labels, masks = self.transform(
                image, boxes, labels, index, epoch, masks=masks
            )
        elif self.transform is not None:
            image, boxes, labels = self.transform(image, boxes, labels, index, epoch)
        # uint8: `unit_float`
        tensor = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).contiguous()
        target = {
            "boxes": torch.as_tensor(np.asarray(boxes, dtype=np.float32).reshape(-1, 4)),
            "labels": torch.as_tensor(np.asarray(labels, dtype=np.int64)),
            "image_id": record.image_id,
        }
        if masks is not None:
            target["masks"] = torch.from_numpy(np.ascontiguousarray(masks, dtype=np.uint8))
        return tensor, target

    def _load(self, index: int) -> tuple[int, np.ndarray]:
        """Read the image at `index` and check its size against the annotation file's; in training
        an unreadable one is replaced by the next readable index."""
        index, image = self._bad.read(self._candidates(index), self._read)
        record = self.index.record(index)
        if image.shape[:2] != (record.height, record.width):
            h, w = image.shape[:2]
            turned = (w, h) == (record.height, record.width) and exif_orientation(
                self._bytes(index)
            ) >= 5
            why = (
                "its EXIF orientation turns it by 90 degrees, and the annotations describe the "
                "pixels as stored; remove its orientation tag (exiftool -Orientation= <file>) or "
                "annotate the upright image"
                if turned
                else "fix the annotation file's width / height or the image"
            )
            raise ImageSizeMismatch(
                f"{self._where(index)} reads as {w}x{h} (upright) but {self.ann_file.name} says "
                f"image {record.image_id} is {record.width}x{record.height}: {why}"
            )
        return index, image

    # where images come from (a packed split reads them from its shards instead:
    # `visiondist.data.shards.packed_coco`)
    def _candidates(self, index: int):
        """(index, name) of the sample and of its replacements in training: the next indexes,
        wrapping round."""
        n = len(self.index)
        return ((i % n, str(self.index.paths[i % n])) for i in range(index, index + n))

    def _read(self, name: str) -> np.ndarray:
        return read_rgb(name)

    def _bytes(self, index: int) -> bytes:
        return Path(self.index.paths[index]).read_bytes()

    def _where(self, index: int) -> str:
        return str(self.index.paths[index])

    def image_by_id(self, image: dict) -> np.ndarray:
        """The upright pixels of an annotation file's image entry (the val plots)."""
        return read_rgb(safe_image_path(self.image_root, image["file_name"]))


def collate_detection(batch: list) -> tuple[list[torch.Tensor], list[dict]]:
    images, targets = zip(*batch)
    return list(images), list(targets)
