"""COCO-format sets in the layouts COCO itself and annotation tools write, recognised from the
folder: where each split's annotation file and images are.

- COCO: annotations/instances_<split>.json, the images in <split>/ or images/<split>/;
- CVAT and Label Studio (their COCO exports): annotations/instances_<split>.json, the images in
  images/<split>/ or images/ (where the files name their images from images/: "val/000.jpg");
- Roboflow: <split>/_annotations.coco.json beside the split's images;
- Label Studio's COCO export: result.json beside images/ (its `file_name`s start with images/), one
  split, read as `result`.

Roboflow names the validation split `valid`; a split asked for as `val` is read from `valid/` where
there is no `val/`. Its category 0 names the group of the others and labels nothing: `group_of`
finds such a category, `ungrouped` reads a file without it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # PIL, where a group is dropped
    from visiondist.data.formats.labels import SplitIndex

ROBOFLOW_FILE = "_annotations.coco.json"
LABEL_STUDIO_FILE = "result.json"
VAL_NAMES = ("val", "valid", "validation")


@dataclass(frozen=True)
class CocoLayout:
    """The data config's `images` and `annotations` patterns ({split} in each) of a COCO-format
    tree, and the split names found there."""

    name: str  # "COCO", "Roboflow", "CVAT / Label Studio"
    images: str
    annotations: str
    splits: tuple[str, ...]

    def split_name(self, asked: str) -> str:
        """The split `asked` as this layout names it (val: Roboflow's `valid`)."""
        if asked in self.splits or asked not in VAL_NAMES:
            return asked
        return next((s for s in VAL_NAMES if s in self.splits), asked)


def find_layout(root: Path) -> Optional[CocoLayout]:
    """The COCO layout of `root`, or None when it holds no COCO annotation file where a layout puts
    one."""
    roboflow = tuple(sorted(p.parent.name for p in root.glob(f"*/{ROBOFLOW_FILE}")))
    if roboflow:
        return CocoLayout("Roboflow", "{split}", "{split}/" + ROBOFLOW_FILE, roboflow)
    if (root / "images").is_dir() and _a_coco_file(root / LABEL_STUDIO_FILE):
        return CocoLayout("Label Studio", "", LABEL_STUDIO_FILE, ("result",))
    files = sorted((root / "annotations").glob("instances_*.json"))
    if not files:
        return None
    splits = tuple(f.stem.removeprefix("instances_") for f in files)
    candidates = (
        ("{split}", "COCO"),
        ("images/{split}", "CVAT / Label Studio"),
        ("images", "CVAT / Label Studio"),
    )
    # the folder the files' first image is in (an export whose file_name holds the split's folder,
    # "val/000.jpg", keeps its images in images/val/ and names them from images/), else the first
    # folder of each split that is there
    for found in (_holds_first, lambda folder, _: folder.is_dir()):
        for images, name in candidates:
            if all(found(root / images.format(split=s), f) for s, f in zip(splits, files)):
                return CocoLayout(name, images, "annotations/instances_{split}.json", splits)
    return None


# how far into an annotation file its first image's file_name is looked for
FIRST_NAME_BYTES = 1 << 20


def _holds_first(folder: Path, annotations: Path) -> bool:
    """Whether `folder` holds the first image `annotations` names (read from its first MB)."""
    try:
        with open(annotations, "rb") as f:
            head = f.read(FIRST_NAME_BYTES)
    except OSError:
        return False
    match = re.search(rb'"file_name"\s*:\s*"((?:[^"\\]|\\.)*)"', head)
    if match is None:
        return False
    name = json.loads(b'"' + match.group(1) + b'"')
    return (folder / name).is_file()


def _a_coco_file(path: Path) -> bool:
    """`path` is a JSON object (COCO's form), not a list (Label Studio's own JSON export, also
    result.json)."""
    try:
        with open(path, "rb") as f:
            return f.read(4096).lstrip().startswith(b"{")
    except OSError:
        return False


def coco_paths(cfg, split: str) -> tuple[Path, Path]:
    """(image folder, annotation file) of a split of a COCO-format data config.

    Args:
        cfg: the data config (its `root`, `images` and `annotations` patterns).
        split: the split's name, e.g. cfg.val_split.

    Returns:
        The split's image folder and its annotation file (neither checked).
    """
    root = Path(cfg.root).expanduser()
    return root / cfg.images.format(split=split), root / cfg.annotations.format(split=split)


# -- a tool's COCO file read: its categories without a group name ---------------------------------


def read_coco(path: Path) -> Optional[dict[str, Any]]:
    """A COCO annotation file's contents, or None where there is none."""
    return json.loads(path.read_text()) if path.is_file() else None


def coco_classes(coco: dict[str, Any], group: Optional[str]) -> int:
    """The categories of `coco`, less its `group` name (`group_of`)."""
    return sum(1 for c in coco.get("categories", []) if c.get("name") != group)


def group_of(coco: dict[str, Any]) -> Optional[str]:
    """The category that names the group of every other (Roboflow's category 0: the supercategory
    of the others, with no annotation of its own), or None."""
    categories = coco.get("categories", [])
    used = {a["category_id"] for a in coco.get("annotations", [])}
    for c in categories:
        others = [o for o in categories if o is not c]
        if (
            others
            and c["id"] not in used
            and all(o.get("supercategory") == c["name"] for o in others)
        ):
            return str(c["name"])
    return None


def ungrouped(source: Path) -> SplitIndex:
    """The annotation file `source` without its group category (`group_of`), as an index to
    cache."""
    from visiondist.data.formats.labels import SplitIndex  # noqa: PLC0415 (PIL, rarely needed)

    coco = json.loads(source.read_text())
    group = group_of(coco)
    coco["categories"] = [c for c in coco["categories"] if c["name"] != group]
    return SplitIndex(coco, source.parent)
