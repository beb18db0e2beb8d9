"""Pascal VOC folders: JPEGImages/, Annotations/<id>.xml, ImageSets/Main/<split>.txt.

- The root is the folder that holds JPEGImages/ and Annotations/ (VOC2007/, VOC2012/), or a
  VOCdevkit/ that holds exactly one such folder.
- A split is ImageSets/Main/<split>.txt: one image id a line (train, val, trainval, test).
- An image is JPEGImages/<filename> (the XML's `filename`, else <id>.jpg); its size is the XML's
  `size` (no pixel is read to index the set).
- A box is VOC's 1-based pixel corners: (xmin - 1, ymin - 1, xmax, ymax) in pixels from the
  top-left corner, as detectron2 and torchvision's references read them. A box up to one pixel
  over the image's edge (a 0-based export's xmin 0) is clipped to it and counted; further out, or
  empty, the file is refused.
- `difficult` objects are left out of training and are regions the evaluation ignores (COCO's
  `iscrowd`: a detection on one is neither right nor wrong), as VOC's protocol ignores them.
- Class names: those of labelmap.txt in its order where the set has one (CVAT's VOC export writes
  it, as does `convert.write_voc`: `name:color:parts:actions` lines, `background` left out); else
  VOC's 20 in VOC's order (`VOC_CLASSES`) when every name in the set is one of them; else every name
  found, sorted.
- The XML is read with defusedxml: a file that declares entities is refused, not expanded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from defusedxml import ElementTree
from defusedxml.common import DefusedXmlException

from visiondist.config import ConfigError

VOC_CLASSES = (
    "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
    "tvmonitor",
)  # fmt: skip


@dataclass(frozen=True)
class VocObject:
    name: str
    box: tuple[float, float, float, float]  # (x1, y1, x2, y2) in pixels, 0-based corners
    difficult: bool
    clipped: bool  # up to a pixel outside the image, clipped to it


@dataclass(frozen=True)
class VocImage:
    """One annotation file read: the image it names, its size and objects."""

    file_name: str  # relative to JPEGImages/
    width: int
    height: int
    objects: tuple[VocObject, ...]


def find_root(root: Path) -> Optional[Path]:
    """The VOC folder at or just under `root` (a VOCdevkit with one VOC20xx inside), or None.

    Raises:
        ConfigError: a VOCdevkit with several sets: name one as data.root.
    """
    if (root / "Annotations").is_dir() and (root / "JPEGImages").is_dir():
        return root
    inside = (
        sorted(p for p in root.iterdir() if p.is_dir() and (p / "Annotations").is_dir())
        if root.is_dir()
        else []
    )
    if len(inside) > 1:
        raise ConfigError(
            f"{root} holds several VOC sets ({', '.join(p.name for p in inside)}): give one as "
            f"data.root, e.g. data.root={inside[-1]}"
        )
    return inside[0] if inside else None


def split_ids(root: Path, split: str) -> list[str]:
    """The image ids of ImageSets/Main/<split>.txt.

    Raises:
        ConfigError: no such split (naming those there are).
    """
    listed = root / "ImageSets" / "Main" / f"{split}.txt"
    if not listed.is_file():
        there = sorted(
            p.stem for p in (root / "ImageSets" / "Main").glob("*.txt") if "_" not in p.stem
        )
        raise ConfigError(
            f"{listed} does not exist: the VOC splits there are {', '.join(there) or 'none'}; "
            "choose them with data.train_split= / data.val_split="
        )
    return [line.split()[0] for line in listed.read_text().splitlines() if line.strip()]


def read_annotation(path: Path) -> VocImage:
    """An Annotations/<id>.xml.

    Raises:
        ValueError: what is wrong with the file, in a few words (no size, a box outside the image,
            entities declared, not XML).
    """
    try:
        tree = ElementTree.parse(path)
    except DefusedXmlException:
        raise ValueError("declares XML entities (refused, not expanded)") from None
    except ElementTree.ParseError as exc:
        raise ValueError(f"not well-formed XML ({exc})") from None
    node = tree.getroot()
    try:
        width = int(float(node.findtext("size/width") or 0))
        height = int(float(node.findtext("size/height") or 0))
    except ValueError:
        width = height = 0
    if width <= 0 or height <= 0:
        raise ValueError("no <size> with a positive width and height")
    objects = []
    for obj in node.iter("object"):
        name = (obj.findtext("name") or "").strip()
        box_node = obj.find("bndbox")
        if not name or box_node is None:
            raise ValueError("an <object> without a <name> or a <bndbox>")
        try:
            xmin, ymin, xmax, ymax = (
                float(box_node.findtext(k) or "nan") for k in ("xmin", "ymin", "xmax", "ymax")
            )
        except ValueError:
            raise ValueError(f"the box of a {name} is not four numbers") from None
        box = (xmin - 1, ymin - 1, xmax, ymax)
        if not (-1 <= box[0] < box[2] <= width + 1 and -1 <= box[1] < box[3] <= height + 1):
            raise ValueError(
                f"the box of a {name}, ({xmin:g}, {ymin:g}, {xmax:g}, {ymax:g}), is empty or "
                f"outside its {width} x {height} image"
            )
        # up to a pixel over the edge: a 0-based export (xmin 0) or an inclusive xmax + 1, clipped
        inside = (max(box[0], 0.0), max(box[1], 0.0), min(box[2], width), min(box[3], height))
        difficult = (obj.findtext("difficult") or "0").strip() not in ("0", "")
        objects.append(VocObject(name, inside, difficult, inside != box))
    file_name = (node.findtext("filename") or "").strip() or f"{path.stem}.jpg"
    return VocImage(file_name, width, height, tuple(objects))


def labelmap(root: Path) -> Optional[list[str]]:
    """The class names of the set's labelmap.txt, in order, or None without one."""
    path = root / "labelmap.txt"
    if not path.is_file():
        return None
    names = [line.split(":", 1)[0].strip() for line in path.read_text().splitlines()]
    return [n for n in names if n and not n.startswith("#") and n != "background"]


def class_names(root: Path, found: set[str]) -> list[str]:
    """The set's class names: its labelmap.txt's (with any name found that it lacks added after,
    sorted); else VOC's 20 classes in VOC's order when `found` is among them; else `found`, sorted.
    """
    listed = labelmap(root)
    if listed is not None:
        return listed + sorted(found - set(listed))
    if found <= set(VOC_CLASSES):
        return list(VOC_CLASSES)
    return sorted(found)
