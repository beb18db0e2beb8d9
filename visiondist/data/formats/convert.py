"""One detection format written from another (`tools/data.py convert`): every source is first read
as COCO ground truth (a COCO tree as it is; YOLO and VOC through their index), then written as
COCO, YOLO or VOC.

- COCO: <out>/annotations/instances_<split>.json, the images in <out>/<split>/;
- YOLO: <out>/data.yaml (path ., train images/train, val images/val, names), <out>/images/<split>/
  and <out>/labels/<split>/<image>.txt (boxes `class cx cy w h`; an object with a polygon as the
  polygon line, which Ultralytics reads as both), full float precision;
- VOC: <out>/JPEGImages/, <out>/Annotations/<id>.xml (VOC's 1-based corners: xmin = x1 + 1),
  <out>/ImageSets/Main/<split>.txt, <out>/labelmap.txt (the class order, as CVAT writes it); an
  ignored object (`iscrowd`) as `difficult`; ids prefixed with their split's name where two splits
  share an image name.

Images are copied (or linked, `link=True`) under their names relative to the source's image folder,
less a first folder every image of a split shares (a YOLO set's `train/`), into the split's own.
YOLO and VOC hold no box outside its image: boxes and polygon points are clipped to it, as the COCO
reader clips them, and a box with nothing inside is not written; YOLO has no crowd regions (not
written). A round trip (COCO -> YOLO -> COCO, COCO -> VOC -> COCO) of boxes inside their images
gives the same ground truth: the same images, boxes to 1e-6 px, classes and names.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import yaml

from visiondist.data.formats.exports import coco_paths

TARGETS = ("coco", "yolo", "voc")


def place(source: Path, target: Path, link: bool) -> None:
    """`source` at `target` (its folder made; a file there replaced): copied, or linked."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        target.unlink()
    if link:
        os.symlink(source.resolve(), target)
    else:
        shutil.copy2(source, target)


def _names(coco: dict[str, Any]) -> list[Path]:
    """Each image's name in the written split: its file name relative to the source's image
    folder, less a first folder every image of the split shares (a YOLO set's index names its
    images `train/a.jpg` under `images/`: written as `a.jpg` in the split's own folder)."""
    names = [Path(image["file_name"]) for image in coco["images"]]
    firsts = {n.parts[0] if len(n.parts) > 1 else None for n in names}
    if len(firsts) == 1 and None not in firsts:
        return [Path(*n.parts[1:]) for n in names]
    return names


def _by_image(coco: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    anns: dict[int, list[dict[str, Any]]] = {image["id"]: [] for image in coco["images"]}
    for ann in coco["annotations"]:
        anns.setdefault(ann["image_id"], []).append(ann)
    return anns


def write_coco(
    splits: dict[str, tuple[dict, Path]], out: Path, link: bool = False
) -> dict[str, int]:
    """Each split's ground truth (`coco`, its image folder) as a COCO tree in `out`."""
    for split, (coco, image_root) in splits.items():
        images = []
        for image, name in zip(coco["images"], _names(coco)):
            place(image_root / image["file_name"], out / split / name, link)
            images.append({**image, "file_name": name.as_posix()})
        (out / "annotations").mkdir(parents=True, exist_ok=True)
        (out / "annotations" / f"instances_{split}.json").write_text(
            json.dumps({**coco, "images": images})
        )
    return {}  # no image renamed: each split has its folder


def write_yolo(
    splits: dict[str, tuple[dict, Path]], out: Path, link: bool = False
) -> dict[str, int]:
    """Each split as a YOLO set in `out`, with its data.yaml (the classes in category-id order)."""
    names: list[str] = []
    for split, (coco, image_root) in splits.items():
        categories = sorted(coco["categories"], key=lambda c: c["id"])
        index_of = {c["id"]: i for i, c in enumerate(categories)}
        names = [c["name"] for c in categories]
        anns = _by_image(coco)
        for image, relative in zip(coco["images"], _names(coco)):
            place(image_root / image["file_name"], out / "images" / split / relative, link)
            width, height = image["width"], image["height"]
            lines = [
                _yolo_line(index_of[a["category_id"]], a, width, height)
                for a in anns[image["id"]]
                if not a.get("iscrowd", 0) and _representable(a, width, height)
            ]
            label = (out / "labels" / split / relative).with_suffix(".txt")
            label.parent.mkdir(parents=True, exist_ok=True)
            label.write_text("".join(f"{line}\n" for line in lines))
    spec = {"path": ".", **{s: f"images/{s}" for s in splits}, "names": names}
    (out / "data.yaml").write_text(yaml.safe_dump(spec, sort_keys=False, allow_unicode=True))
    return {}  # no image renamed: each split has its folder


def _clipped_box(ann: dict[str, Any], width: int, height: int) -> tuple[float, ...]:
    """The annotation's box (x1, y1, x2, y2) inside its image, as the COCO reader clips it."""
    x, y, w, h = (float(v) for v in ann["bbox"])
    return (min(max(x, 0.0), width), min(max(y, 0.0), height),
            min(max(x + w, 0.0), width), min(max(y + h, 0.0), height))  # fmt: skip


def _yolo_line(label: int, ann: dict[str, Any], width: int, height: int) -> str:
    """A box as `class cx cy w h`, a polygon as `class x1 y1 ...`, normalised; what lies outside
    the image is clipped to it (YOLO's coordinates are within [0, 1])."""
    polygon = _polygon(ann)
    if polygon:
        sides = [width if i % 2 == 0 else height for i in range(len(polygon))]
        values = [min(max(v, 0.0), side) / side for v, side in zip(polygon, sides)]
    else:
        x1, y1, x2, y2 = _clipped_box(ann, width, height)
        w, h = x2 - x1, y2 - y1
        values = [(x1 + w / 2) / width, (y1 + h / 2) / height, w / width, h / height]
    return " ".join([str(label), *(repr(float(v)) for v in values)])


def _representable(ann: dict[str, Any], width: int, height: int) -> bool:
    """A box with an area left inside its image (the others are not written: no format but COCO
    holds a box outside its image)."""
    x1, y1, x2, y2 = _clipped_box(ann, width, height)
    return x2 > x1 and y2 > y1


def _polygon(ann: dict[str, Any]) -> list[float]:
    """The annotation's one polygon, or [] (a box, an RLE or a multi-part mask: written as its
    box)."""
    segmentation = ann.get("segmentation")
    if isinstance(segmentation, list) and len(segmentation) == 1 and len(segmentation[0]) >= 6:
        return [float(v) for v in segmentation[0]]
    return []


def write_voc(
    splits: dict[str, tuple[dict, Path]], out: Path, link: bool = False
) -> dict[str, int]:
    """Each split as a Pascal VOC set in `out` (image ids: the file names without their suffix,
    folders joined by `_`). VOC keeps every split's images in one folder: where two images would
    get one id (train/000001.jpg and val/000001.jpg), every id is prefixed with its split's name
    (`val_000001`), so that no image replaces another. Returns each split's renamed images."""
    ids = {split: [_voc_id(n) for n in _names(coco)] for split, (coco, _) in splits.items()}
    every = [i for split_ids in ids.values() for i in split_ids]
    shared = len(set(every)) < len(every)
    if shared:
        ids = {split: [f"{split}_{i}" for i in split_ids] for split, split_ids in ids.items()}
    for split, (coco, image_root) in splits.items():
        names = {c["id"]: c["name"] for c in coco["categories"]}
        anns = _by_image(coco)
        for image, image_id in zip(coco["images"], ids[split]):
            source = image_root / image["file_name"]
            target = out / "JPEGImages" / f"{image_id}{source.suffix}"
            place(source, target, link)
            kept = [
                a for a in anns[image["id"]] if _representable(a, image["width"], image["height"])
            ]
            xml = _voc_xml(target.name, image, [(names[a["category_id"]], a) for a in kept])
            (out / "Annotations").mkdir(parents=True, exist_ok=True)
            (out / "Annotations" / f"{image_id}.xml").write_text(xml)
        (out / "ImageSets" / "Main").mkdir(parents=True, exist_ok=True)
        (out / "ImageSets" / "Main" / f"{split}.txt").write_text(
            "".join(f"{i}\n" for i in ids[split])
        )
        ordered = [c["name"] for c in sorted(coco["categories"], key=lambda c: c["id"])]
        (out / "labelmap.txt").write_text(  # the class order, as CVAT's VOC export writes it
            "# label:color_rgb:parts:actions\n" + "".join(f"{n}:::\n" for n in ordered)
        )
    return {split: len(split_ids) if shared else 0 for split, split_ids in ids.items()}


def _voc_id(relative: Path) -> str:
    return relative.with_suffix("").as_posix().replace("/", "_")


# a corner this close to a whole pixel is that pixel: YOLO's 6-digit normalised fields give
# 103.99984 for 104 (an image's size times 5e-7 at most: 1e-3 px up to 2000 px)
WHOLE_PIXEL = 1e-3


def _voc_number(value: float) -> str:
    """A VOC corner as VOC writes them, a whole pixel, where it is one up to `WHOLE_PIXEL`; else
    the box's own fraction (a COCO box's), to 1e-6 px."""
    if abs(value - round(value)) <= WHOLE_PIXEL:
        return str(int(round(value)))
    return repr(round(float(value), 6))


def _voc_xml(file_name: str, image: dict[str, Any], objects: list[tuple[str, dict]]) -> str:
    parts = [
        "<annotation>",
        f"  <filename>{escape(file_name)}</filename>",
        f"  <size><width>{image['width']}</width><height>{image['height']}</height>"
        "<depth>3</depth></size>",
    ]
    for name, ann in objects:
        x1, y1, x2, y2 = _clipped_box(ann, image["width"], image["height"])
        corners = (x1 + 1, y1 + 1, x2, y2)
        parts += [
            "  <object>",
            f"    <name>{escape(name)}</name>",
            f"    <difficult>{int(bool(ann.get('iscrowd', 0)))}</difficult>",
            "    <bndbox>"
            + "".join(
                f"<{k}>{_voc_number(v)}</{k}>"
                for k, v in zip(("xmin", "ymin", "xmax", "ymax"), corners)
            )
            + "</bndbox>",
            "  </object>",
        ]
    return "\n".join([*parts, "</annotation>", ""])


WRITERS = {"coco": write_coco, "yolo": write_yolo, "voc": write_voc}  # each returns the renamed


def convert(d: Any, target: str, out: Path, link: bool = False) -> dict[str, dict[str, int]]:
    """The train and val splits of a detection data config, written as `target` into `out`.

    Args:
        d: the data config, resolved (`resolve.resolve_detection`): its splits readable as COCO.
        target: coco, yolo or voc.
        out: the folder to write (made; files of the same names are replaced).
        link: link the images instead of copying them.

    Returns:
        Each split's counts: images and objects written, the objects `target` cannot hold
        (YOLO: crowd regions; YOLO and VOC: a box with no area inside its image), left out, and
        the images VOC's one folder renamed.
    """
    sources = {}
    for name, split in (("train", d.train_split), ("val", d.val_split)):
        images, annotations = coco_paths(d, split)
        sources[name] = (json.loads(annotations.read_text()), images)
    out.mkdir(parents=True, exist_ok=True)
    renamed = WRITERS[target](sources, out, link)
    return {
        name: {
            **written(coco, target),
            "images named <split>_<name>: names both splits use": renamed.get(name, 0),
        }
        for name, (coco, _) in sources.items()
    }


def written(coco: dict[str, Any], target: str) -> dict[str, int]:
    """A split's images and objects as `target` holds them, and what it leaves out, counted."""
    sizes = {image["id"]: (image["width"], image["height"]) for image in coco["images"]}
    crowd = difficult = outside = 0
    for ann in coco["annotations"]:
        if target == "coco":
            continue
        if target == "yolo" and ann.get("iscrowd", 0):
            crowd += 1
        elif not _representable(ann, *sizes[ann["image_id"]]):
            outside += 1
        elif ann.get("iscrowd", 0):
            difficult += 1
    return {
        "images": len(coco["images"]),
        "objects": len(coco["annotations"]) - crowd - outside,
        "crowd regions left out (YOLO holds none)": crowd,
        "crowd regions written as difficult": difficult,
        "boxes with no area inside their image left out": outside,
    }
