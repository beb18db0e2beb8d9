"""A YOLO or VOC split turned into COCO's ground truth: the one index every rank, the evaluation and
prediction read, whatever format the labels came in.

Built in the launching process, before any rank starts: the split's images and label files are read
by a pool of processes over the CPUs this process may use (`utils.procenv.usable_cpus`), a chunk of
images each, and merged in the split's order. YOLO's images are opened for their size (the header
alone, upright as the loader reads them: EXIF orientation applied); VOC's XML carries it.

What each split holds, in COCO's terms: images numbered from 1 in the split's order, `file_name`
relative to `image_root`, pixel boxes (rounded to 1e-6 px, so that the same boxes written as YOLO,
VOC or COCO give the same numbers), polygons as COCO polygons, VOC's difficult objects as `iscrowd`
(out of training, ignored by the evaluation), categories numbered from 1 in the order of the names;
an object listed twice in an image is kept once, counted.

What is wrong is named (file, line, reason) in `problems` and counted in `counts`; the caller
refuses a val split with any, and leaves the bad lines of a train split out, counted.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from PIL import Image

from visiondist.data.formats.voc import VocImage, read_annotation
from visiondist.data.formats.yolo import YoloSet, label_file, label_path, list_images, parse_line
from visiondist.utils.procenv import usable_cpus

CHUNK = 256  # images a worker reads per task
_ORIENTATION_TAG = 0x0112


@dataclass(frozen=True)
class Problem:
    """A label the index could not use: the file, its line (0: the file as a whole), why."""

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}{f':{self.line}' if self.line else ''}: {self.reason}"


@dataclass
class SplitIndex:
    """One split as COCO ground truth, with what reading it found wrong and what it counted."""

    coco: dict[str, Any]
    image_root: Path
    problems: list[Problem] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)


def _px(value: float) -> float:
    return round(value, 6)


def upright_size(path: Path) -> tuple[int, int]:
    """(width, height) of an image as the loader decodes it: EXIF orientations 5-8 swap them."""
    with Image.open(path) as image:  # the header alone
        width, height = image.size
        orientation = int(image.getexif().get(_ORIENTATION_TAG, 1)) if image.format in (
            "JPEG", "PNG", "TIFF", "WEBP", "MPO"
        ) else 1  # fmt: skip
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


# -- YOLO
# -------------------------------------------------------------------------------------------


def _yolo_image(image: Path, num_classes: int) -> dict[str, Any]:
    """One image of a YOLO split: its size, objects (pixels) and problems; runs in a worker."""
    out: dict[str, Any] = {"problems": [], "objects": [], "clipped": 0, "labelled": False}
    try:
        width, height = upright_size(image)
    except Exception as exc:  # unreadable, truncated, not an image: named, never indexed
        out["problems"].append(Problem(str(image), 0, f"unreadable image ({type(exc).__name__})"))
        return out
    out["size"] = (width, height)
    labels = label_file(str(image))
    try:
        with open(labels, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return out
    except (OSError, UnicodeDecodeError) as exc:
        out["problems"].append(Problem(labels, 0, f"unreadable ({exc})"))
        return out
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            parsed = parse_line(line.strip(), num_classes)
        except ValueError as exc:
            out["problems"].append(Problem(labels, number, str(exc)))
            continue
        x1, y1, x2, y2 = parsed.box
        box = [_px(x1 * width), _px(y1 * height), _px(x2 * width), _px(y2 * height)]
        polygon = [_px(v * (width if i % 2 == 0 else height)) for i, v in enumerate(parsed.polygon)]
        out["objects"].append((parsed.label, box, polygon))
        out["clipped"] += parsed.clipped
    out["labelled"] = bool(out["objects"])
    return out


def _yolo_chunk(task: tuple[list[Path], int]) -> list[dict[str, Any]]:
    images, num_classes = task
    return [_yolo_image(image, num_classes) for image in images]


def index_yolo(
    dataset: YoloSet,
    split: str,
    image_root: Path,
    workers: int,
    images: Optional[list[Path]] = None,
) -> SplitIndex:
    """The YOLO split `split` of `dataset` as COCO ground truth.

    Args:
        dataset: the data.yaml read.
        split: train, val or test.
        image_root: the folder `file_name`s are relative to (holds every image of the set).
        workers: processes reading the images and labels.
        images: the split's images (`list_images`), where the caller has listed them.

    Returns:
        The split's index.
    """
    images = list_images(dataset.splits[split]) if images is None else images
    num_classes = len(dataset.names)
    results = _map(_yolo_chunk, [(images[i : i + CHUNK], num_classes)
                                 for i in range(0, len(images), CHUNK)], workers)  # fmt: skip
    index = SplitIndex(_coco_skeleton(dataset.names), image_root)
    for image, result in zip(images, (r for chunk in results for r in chunk)):
        index.problems += result["problems"]
        if "size" not in result:
            index.counts["unreadable images"] += 1
            continue
        objects = [(label + 1, box, polygon, False) for label, box, polygon in result["objects"]]
        _add_image(index, image, result["size"], objects)
        index.counts["images without labels"] += not result["labelled"]
        index.counts["clipped to the image"] += result["clipped"]
    index.counts["bad label lines"] = sum(1 for p in index.problems if p.line)
    for orphan in _orphan_labels(dataset.splits[split], images):
        index.problems.append(Problem(str(orphan), 0, "a label file without an image"))
        index.counts["label files without an image"] += 1
    return index


def _orphan_labels(sources: list[Path], images: list[Path]) -> list[Path]:
    """The label files under the label folders of a split's image folders that no image names."""
    named = {label_file(str(image)) for image in images}
    orphans: list[str] = []
    for source in sources:
        if not source.is_dir():
            continue
        folder = label_path(source / "x.jpg").parent
        if folder == source or not folder.is_dir():
            continue
        for path, _, files in os.walk(folder):
            orphans += [os.path.join(path, f) for f in files if f.endswith(".txt")]
    return [Path(p) for p in sorted(orphans, key=lambda p: p.split(os.sep)) if p not in named]


# -- VOC
# --------------------------------------------------------------------------------------------


def _voc_chunk(paths: list[Path]) -> list[Any]:
    out: list[Any] = []
    for path in paths:
        try:
            out.append(read_annotation(path))
        except FileNotFoundError:
            out.append(Problem(str(path), 0, "the split lists this image but it has no annotation"))
        except (OSError, ValueError) as exc:
            out.append(Problem(str(path), 0, str(exc)))
    return out


def read_voc(root: Path, ids: list[str], workers: int) -> list[VocImage | Problem]:
    """The annotation files of `ids`, read in parallel, in order."""
    paths = [root / "Annotations" / f"{i}.xml" for i in ids]
    chunks = [paths[i : i + CHUNK] for i in range(0, len(paths), CHUNK)]
    return [r for chunk in _map(_voc_chunk, chunks, workers) for r in chunk]


def index_voc(root: Path, read: list[VocImage | Problem], names: list[str]) -> SplitIndex:
    """A VOC split as COCO ground truth (`read`: its annotation files read by `read_voc`).

    Args:
        root: the VOC folder (JPEGImages/ beside Annotations/).
        read: each listed image's annotation, or the problem reading it.
        names: the class names, in category order.

    Returns:
        The split's index.
    """
    index = SplitIndex(_coco_skeleton(names), root / "JPEGImages")
    label_of = {name: i + 1 for i, name in enumerate(names)}
    for entry in read:
        if isinstance(entry, Problem):
            index.problems.append(entry)
            continue
        image = index.image_root / entry.file_name
        if not image.is_file():
            index.problems.append(Problem(str(image), 0, "the annotation's image does not exist"))
            continue
        objects: list[tuple[int, list[float], list[float], bool]] = [
            (label_of[o.name], [_px(v) for v in o.box], [], o.difficult) for o in entry.objects
        ]
        _add_image(index, image, (entry.width, entry.height), objects)
        index.counts["images without objects"] += not entry.objects
        index.counts["difficult objects"] += sum(o.difficult for o in entry.objects)
        index.counts["clipped (a pixel over the edge)"] += sum(o.clipped for o in entry.objects)
    index.counts["bad annotation files"] = len(index.problems)
    return index


# -- COCO's form
# ------------------------------------------------------------------------------------


def _coco_skeleton(names: list[str]) -> dict[str, Any]:
    categories = [{"id": i + 1, "name": name, "supercategory": ""} for i, name in enumerate(names)]
    return {"images": [], "annotations": [], "categories": categories}


def _add_image(index: SplitIndex, image: Path, size: tuple[int, int], objects: list[tuple]) -> None:
    """Append an image and its objects ((category id, xyxy box, polygon, ignored)) to the index; an
    object repeated in the same image (a label line written twice) is kept once and counted, as
    Ultralytics drops duplicate labels: twice the ground truth would halve the scores."""
    coco = index.coco
    unique = list({(c, tuple(b), tuple(p), i): None for c, b, p, i in objects})
    index.counts["duplicates left out"] += len(objects) - len(unique)
    objects = [(c, list(b), list(p), i) for c, b, p, i in unique]
    image_id = len(coco["images"]) + 1
    file_name = image.relative_to(index.image_root).as_posix()
    coco["images"].append(
        {"id": image_id, "file_name": file_name, "width": size[0], "height": size[1]}
    )
    for category, (x1, y1, x2, y2), polygon, ignored in objects:
        w, h = _px(x2 - x1), _px(y2 - y1)
        annotation = {
            "id": len(coco["annotations"]) + 1,
            "image_id": image_id,
            "category_id": category,
            "bbox": [x1, y1, w, h],
            "area": _px(_polygon_area(polygon)) if polygon else _px(w * h),
            "iscrowd": int(ignored),
        }
        if polygon:
            annotation["segmentation"] = [polygon]
        coco["annotations"].append(annotation)
    index.counts["images"] += 1
    index.counts["boxes"] += len(objects)


def _polygon_area(polygon: list[float]) -> float:
    xs, ys = polygon[0::2], polygon[1::2]
    n = len(xs)
    return abs(sum(xs[i] * ys[(i + 1) % n] - xs[(i + 1) % n] * ys[i] for i in range(n))) / 2


def _map(function, tasks: list, workers: int) -> list:
    """`function` over `tasks` in order, in `workers` forked processes (in this one for one)."""
    workers = max(1, min(workers, len(tasks)))
    if workers == 1:
        return [function(t) for t in tasks]
    with multiprocessing.get_context("fork").Pool(workers, initializer=_pool_worker) as pool:
        return pool.map(function, tasks, chunksize=1)


def _pool_worker() -> None:
    """A pool worker ends quietly when the pool ends it (SIGTERM, as the pool closes), not through
    the stop handling it inherited from the tool (a `StopNow` traceback each); Ctrl-C is the
    parent's, which ends the pool."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def default_workers() -> int:
    """The processes an index is read with: every CPU this process may use."""
    return usable_cpus()
