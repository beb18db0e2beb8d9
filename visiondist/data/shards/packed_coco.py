"""COCO-format data in shards: `pack_coco` writes each split's images (in image-id order, the
dataset's own) as WebDataset tars with `<key>.json` naming the image id, and copies the split's
annotation file beside them (`<split>-annotations.json`: the boxes, and COCOeval's ground truth);
`ShardCoco` is `CocoDetection` with its images read from the shards."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from visiondist.data.coco import CocoDetection, no_annotation_file
from visiondist.data.coco_records import safe_image_path
from visiondist.data.decode import decode_rgb
from visiondist.data.shards.dataset import PackedImages, key_of, read_meta
from visiondist.data.shards.pack import (
    PackError,
    PackOptions,
    check_plan,
    claim,
    describe_pack,
    finish,
    plan,
    write_all,
    write_index,
)
from visiondist.data.shards.store import ShardError, ShardStore


def pack_coco(
    splits: dict[str, tuple[Path, Path]], out: Path, options: PackOptions, source: Path
) -> dict:
    """Pack COCO splits (split -> (image folder, annotation file)) into `out`; returns
    dataset.json's content."""
    out = Path(out)
    plans, categories = {}, None
    for split, (images, ann_file) in splits.items():
        if not ann_file.is_file():
            raise PackError(no_annotation_file(ann_file))
        dataset = json.loads(ann_file.read_text())
        cats = sorted((c["id"], c["name"]) for c in dataset.get("categories", []))
        if categories is not None and cats != categories:
            raise PackError(f"the categories of {ann_file} differ from those of the first split")
        categories = cats
        entries = sorted(dataset.get("images", []), key=lambda im: im["id"])
        try:
            paths = [str(safe_image_path(images, im["file_name"])) for im in entries]
        except ValueError as exc:
            raise PackError(str(exc)) from None
        missing = [p for p in paths if not Path(p).is_file()]
        if missing:
            raise PackError(f"{len(missing)} images of {ann_file} are missing, e.g. {missing[0]}")
        plans[split] = plan(
            split,
            paths,
            np.asarray([im["id"] for im in entries], np.int64),
            options,
            shuffle=False,
            kind="detection",
        )
    claim(out, options.overwrite)
    plans = check_plan(out, plans, options)
    records = write_all(out, [job for split in splits for job in plans[split]], options)
    assert categories is not None, "splits names at least one split"
    meta = describe_pack("detection", [name for _, name in categories], source, options)
    meta["categories"] = [{"id": cid, "name": name} for cid, name in categories]
    for split, (_, ann_file) in splits.items():
        copy = out / f"{split}-annotations.json"
        shutil.copyfile(ann_file, copy)
        extra = {
            "annotations": copy.name,
            "annotations_sha256": hashlib.sha256(copy.read_bytes()).hexdigest(),
            "annotations_size": copy.stat().st_size,
        }
        meta["splits"][split] = write_index(out, split, plans[split], records, extra)
    return finish(out, meta)


class ShardCoco(CocoDetection):
    """`CocoDetection` over a packed split: the same records, rules and transform; images from the
    shards."""

    def __init__(
        self,
        store: ShardStore,
        split: str,
        train: bool,
        transform: Optional[Callable] = None,
        max_bad_images: int = 10,
        meta: Optional[dict] = None,
        masks: bool = False,
    ):
        meta = meta or read_meta(store)
        if meta.get("kind") != "detection":
            raise ShardError(
                f"{store.url('dataset.json')} holds {meta.get('kind')} data: a detector needs a "
                "packed COCO data set (tools/data.py pack data=coco ...)"
            )
        self.packed = PackedImages(store, split, meta)
        super().__init__(
            Path(split), self.packed.file("annotations"), train, transform, max_bad_images, masks
        )
        self.store = store
        # packed in image-id order already; kept general
        order = np.argsort(self.packed.labels, kind="stable")
        self._position = order[
            np.searchsorted(self.packed.labels, self.index.image_ids, sorter=order)
        ]
        shard_of_record = self.packed.shard[self._position]
        self.shard_starts = np.searchsorted(shard_of_record, np.arange(len(self.packed.shards) + 1))

    def _candidates(self, index: int):
        n = len(self.index)
        return (
            (i % n, self.packed.name(int(self._position[i % n]))) for i in range(index, index + n)
        )

    def _read(self, name: str) -> np.ndarray:
        return decode_rgb(self.packed.image_bytes(key_of(name)), name)

    def _bytes(self, index: int) -> bytes:
        return self.packed.image_bytes(int(self._position[index]))

    def _where(self, index: int) -> str:
        return self.packed.name(int(self._position[index]))

    def image_by_id(self, image: dict) -> np.ndarray:
        position = int(np.flatnonzero(self.packed.labels == image["id"])[0])
        return decode_rgb(self.packed.image_bytes(position), self.packed.name(position))
