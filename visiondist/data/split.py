"""A validation split cut from a set that has only one (`tools/data.py split`): class folders with
no val/, an annotation tool's export of one task, a YOLO set without `val:`.

- Class folders (`<root>/<class>/<image>`, or `<root>/train/<class>/<image>`): each class's images
  are shuffled with the seed and `val` of them (rounded; at least one, never all) go to
  `<out>/val/<class>/`, the rest to `<out>/train/<class>/`: every class in both splits, in the set's
  proportions (stratified). A class of one image cannot be in both: refused, named. Images that
  cannot be read (empty, truncated, not an image) are left out, named and counted, as the launch
  would refuse them in val.
- Detection (any format `data=detection` reads): the split's images, shuffled with the seed, `val`
  of them (at least one) with their objects to the val split; written as COCO (or YOLO, VOC) by
  `visiondist.data.formats.convert`'s writers, the class names and ids kept.

The same set, `val` and seed give the same split on any machine (the images are ordered by name
before the shuffle). Images are copied, or linked (`link`).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

from visiondist.config import ConfigError
from visiondist.data.formats.convert import WRITERS, place, written
from visiondist.data.formats.exports import coco_paths
from visiondist.data.index import list_image_folder
from visiondist.data.robust import unreadable_reason


def check_fraction(val: float) -> None:
    if not 0 < val < 1:
        raise ConfigError(
            f"val={val:g}: the share of the images for validation, between 0 and 1, e.g. val=0.1"
        )


def check_out(source: Path, out: Path) -> None:
    """`out` is a new or empty folder outside the set it is cut from (inside, it would become one
    of the set's classes)."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"out={out} is not empty: give a new folder for the split set")
    if out.resolve().is_relative_to(source.resolve()):
        raise ConfigError(
            f"out={out} is inside data.root={source}: give a folder outside the set (inside, it "
            "would read as one more class)"
        )


def _val_count(n: int, val: float) -> int:
    """How many of `n` images go to val: `val` of them rounded, at least one, never all."""
    return min(n - 1, max(1, round(n * val)))


def class_folders(root: Path, train_split: str) -> Path:
    """The folder of class folders to split: `<root>/<train_split>` where the set has one, else
    `root`."""
    inner = root / train_split
    return inner if inner.is_dir() else root


def split_image_folder(
    source: Path, out: Path, val: float, seed: int = 0, link: bool = False
) -> tuple[dict[str, dict[str, int]], list[tuple[str, str]]]:
    """`source/<class>/<image>` as `out/train/<class>/` and `out/val/<class>/`.

    Returns:
        Each class's images in train and in val, and the images left out (unreadable) with why.
    """
    check_fraction(val)
    classes, index, labels = list_image_folder(source, cache=False)
    by_class: dict[int, list[str]] = defaultdict(list)
    unreadable: list[tuple[str, str]] = []
    for i, label in enumerate(labels):
        relative = index.relative(i)
        reason = unreadable_reason(source / relative)
        if reason is None:
            by_class[int(label)].append(relative)
        else:
            unreadable.append((relative, reason))
    few = [f"{name} ({len(by_class[k])})" for k, name in enumerate(classes) if len(by_class[k]) < 2]
    if few:
        raise ConfigError(
            f"{source}: {', '.join(few)}: a class needs 2 images or more to be in both splits "
            "(training reads the same classes in each): add images, or move that class's folder "
            "out of the set"
        )
    counts: dict[str, dict[str, int]] = {}
    rng = random.Random(seed)
    for label, name in enumerate(classes):
        images = sorted(by_class[label])
        rng.shuffle(images)
        k = _val_count(len(images), val)
        for split, part in (("val", images[:k]), ("train", images[k:])):
            for relative in part:
                place(source / relative, out / split / relative, link)
        counts[name] = {"train": len(images) - k, "val": k}
    return counts, unreadable


def split_detection(
    d: Any, out: Path, val: float, seed: int = 0, link: bool = False, target: str = "coco"
) -> dict[str, dict[str, int]]:
    """The one split `d` resolves to (`d.val_split`, read as COCO) cut into train and val, written
    as `target` into `out`.

    Returns:
        Each written split's counts (`convert.written`).
    """
    check_fraction(val)
    images_dir, annotations = coco_paths(d, d.val_split)
    coco = json.loads(annotations.read_text())
    ordered = sorted(coco["images"], key=lambda image: image["file_name"])
    if len(ordered) < 2:
        raise ConfigError(
            f"{annotations}: {len(ordered)} image: cutting a val split takes two or more"
        )
    random.Random(seed).shuffle(ordered)
    val_ids = {image["id"] for image in ordered[: _val_count(len(ordered), val)]}

    def part(in_val: bool) -> dict[str, Any]:
        return {
            **coco,
            "images": [i for i in coco["images"] if (i["id"] in val_ids) == in_val],
            "annotations": [a for a in coco["annotations"] if (a["image_id"] in val_ids) == in_val],
        }

    sources = {"train": (part(False), images_dir), "val": (part(True), images_dir)}
    out.mkdir(parents=True, exist_ok=True)
    WRITERS[target](sources, out, link)
    return {name: written(coco_part, target) for name, (coco_part, _) in sources.items()}
