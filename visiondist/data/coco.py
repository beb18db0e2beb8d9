"""COCO-format detection data (real COCO and the built-in `shapes_coco` go through this same code):
the dataset (`CocoDetection`), its images read by index (`CocoIndex`), and the batches' collation.
The annotation file is read by `coco_records.py` (its rules, each counted and logged when the
dataset is built, are listed there).

- images are decoded by `visiondist.data.decode.read_rgb`, as in classification: upright (EXIF
  orientation applied), 16-bit scaled to 8, grey / CMYK / palette / RGBA converted to RGB; an image
  whose decoded size differs from the annotation file's width / height is an error naming the file
  (its boxes would not fit it), in training too;
- a training image that cannot be read is logged (once per file) and replaced by the next readable
  index; a run of `max_bad_images` consecutive unreadable images is an error. In evaluation an
  unreadable image is an error;
- with `masks` (a model with a mask head) every kept annotation's segmentation is kept as text
  (`visiondist.data.masks.SegmentationIndex`) and decoded to masks at the image's size when the
  image is read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from visiondist.data.coco_records import (
    ImageRecord,
    load_coco,
    read_records,
    safe_image_path,
)
from visiondist.data.decode import exif_orientation, read_rgb
from visiondist.data.index import PathIndex
from visiondist.data.masks import SegmentationIndex, decode
from visiondist.data.robust import BadImages

log = logging.getLogger(__name__)


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


def no_annotation_file(ann_file: Path) -> str:
    """The line for a COCO annotation file that is not there: with the other splits' files beside
    it (`instances_train.json` where data=coco looks for `instances_train2017.json`), their split
    names and data=detection, which finds any."""
    line = f"no COCO annotation file {ann_file}: check data.root and data.annotations"
    beside = sorted(ann_file.parent.glob("instances_*.json")) if ann_file.parent.is_dir() else []
    if not beside:
        return line
    names = [p.stem[len("instances_") :] for p in beside]
    return (
        f"{line}; {ann_file.parent} holds {', '.join(p.name for p in beside)}: set "
        f"data.train_split / data.val_split to their split names (e.g. data.train_split="
        f"{names[0]}), or read it with data=detection, which finds them"
    )


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
            raise FileNotFoundError(no_annotation_file(self.ann_file))
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
