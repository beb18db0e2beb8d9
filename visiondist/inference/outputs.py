"""What a prediction writes, and how it continues after a stop.

Each rank appends one JSON line per item of its share to `parts/rank<r>-<attempt>.jsonl` as its
batches finish (flushed per batch: memory stays bounded on any number of images). An item's line is
its result, or its `error`: an unreadable file is named once in the log, counted, and skipped. The
parts of every attempt are what a continuation reads (`done`): a batch whose every item has a line
is not predicted again. When every rank is done, rank 0 merges the parts in item order (one
streaming k-way merge) into the outputs of the task (`WRITERS`):

- classifiers: `predictions.csv` (file, then label / probability pairs, top-k);
- detectors: `detections.jsonl` (one line per image: boxes in the pixels of the original image,
  scores, class names, the COCO category ids the run was trained with, masks as COCO RLE) and
  `results.json` (COCO's results format, each entry with its image's `file_name`; the image id is
  the annotation file's where the file is one of the run's val images, else the item's position from
  1);
- `unreadable.txt`: each skipped file with its reason;
- drawn images (`images/`, the first `predict.save_images` items, drawn by the rank that predicted
  them) and, for a video, the annotated video.

The merged outputs do not depend on the number of ranks: items are predicted in the same batches
whatever the ranks (`batches`: fixed-size batches of the source's order, whole batches to each
rank)."""

from __future__ import annotations

import colorsys
import csv
import functools
import heapq
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, TextIO

import cv2
import numpy as np
import torch

from visiondist.data.masks import decode
from visiondist.inference.sources import VideoFrames

PARTS = "parts"
MANIFEST = "predict.json"


# -- batches and what is done ----------------------------------------------------------------------


def batches(count: int, size: int) -> list[range]:
    """The source's items in fixed-size batches, in order: the same whatever the ranks."""
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


def part_lines(path: Path) -> Iterator[str]:
    """The complete lines of a part (a stop can leave a last line half written: it is not
    counted)."""
    with open(path, "rb") as f:
        for line in f:
            if line.endswith(b"\n"):
                yield line.decode()


def line_index(line: str) -> int:
    """The item index of a part line (each begins `{"index": <i>,`) without parsing the rest."""
    return int(line[10 : line.index(",", 10)])


def part_files(out: Path) -> list[Path]:
    folder = out / PARTS
    return sorted(folder.glob("rank*.jsonl")) if folder.is_dir() else []


def done(out: Path, count: int) -> np.ndarray:
    """Which items have a line in the parts so far."""
    seen = np.zeros(count, dtype=bool)
    for part in part_files(out):
        for line in part_lines(part):
            i = line_index(line)
            if i < count:
                seen[i] = True
    return seen


def remaining(all_batches: list[range], seen: np.ndarray) -> list[range]:
    return [b for b in all_batches if not seen[b.start : b.stop].all()]


class PartWriter:
    """One rank's part of one attempt: a line per item, flushed per batch."""

    def __init__(self, out: Path, rank: int):
        folder = out / PARTS
        folder.mkdir(parents=True, exist_ok=True)
        attempt = 0
        while (folder / f"rank{rank}-{attempt}.jsonl").exists():
            attempt += 1
        self.path = folder / f"rank{rank}-{attempt}.jsonl"
        self.file = open(self.path, "a")

    def write(self, records: list[dict[str, Any]]) -> None:
        self.file.write("".join(json.dumps(r) + "\n" for r in records))
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def merged(out: Path) -> Iterator[dict[str, Any]]:
    """Every item's record, in item order, once (a batch predicted again after a stop: its first
    lines win)."""
    streams = [((line_index(line), line) for line in part_lines(p)) for p in part_files(out)]
    last = -1
    for index, line in heapq.merge(*streams, key=lambda pair: pair[0]):
        if index != last:
            last = index
            yield json.loads(line)


# -- the merged outputs ----------------------------------------------------------------------------


def write_classifications(records: Iterable[dict], out: Path, topk: int) -> dict[str, int]:
    """predictions.csv: file, label_1, prob_1, ... label_k, prob_k."""
    counts = {"images": 0, "unreadable": 0}
    with _atomic(out / "predictions.csv", newline="") as f, _Unreadable(out) as bad:
        writer = csv.writer(f)
        writer.writerow(
            ["file", *[c for k in range(1, topk + 1) for c in (f"label_{k}", f"prob_{k}")]]
        )
        for r in records:
            if "error" in r:
                bad.add(r)
                continue
            counts["images"] += 1
            writer.writerow(
                [r["file"], *[c for t in r["top"] for c in (t["name"], f"{t['prob']:.6f}")]]
            )
        counts["unreadable"] = bad.count
    return counts


def write_detections(
    records: Iterable[dict], out: Path, image_ids: Callable[[dict], int], save_txt: bool = False
) -> dict[str, int]:
    """detections.jsonl (a line per image) and results.json (COCO results, written as a stream);
    with `save_txt`, labels/ too (`YoloLabels`)."""
    counts = {"images": 0, "detections": 0, "unreadable": 0}
    yolo = YoloLabels(out / "labels") if save_txt else None
    with (
        _atomic(out / "detections.jsonl") as lines,
        _atomic(out / "results.json") as results,
        _Unreadable(out) as bad,
    ):
        results.write("[")
        first = True
        for r in records:
            if "error" in r:
                bad.add(r)
                continue
            counts["images"] += 1
            counts["detections"] += len(r["detections"])
            image_id = image_ids(r)
            lines.write(json.dumps({k: v for k, v in r.items() if k != "index"}) + "\n")
            if yolo is not None:
                yolo.write(r)
            for d in r["detections"]:
                # the model's float32 boxes, as COCO
                x0, y0, x1, y1 = np.asarray(d["box"], dtype=np.float32)
                # scoring
                entry = {
                    "image_id": image_id,
                    "file_name": r["file"],
                    "category_id": d["category_id"],
                    # takes them
                    "bbox": [float(v) for v in (x0, y0, x1 - x0, y1 - y0)],
                    "score": d["score"],
                }
                if "mask" in d:
                    entry["segmentation"] = d["mask"]
                results.write(("" if first else ",") + json.dumps(entry))
                first = False
        results.write("]")
        counts["unreadable"] = bad.count
    return counts


class YoloLabels:
    """A prediction's detections in YOLO's label form, for those who label with them: one
    `labels/<image stem>.txt` an image (empty where nothing was found), a line a detection: `class
    cx cy w h score`, the box's centre and size over the image's width and height, the class its
    position in the trained class names (from 0, as data.yaml's `names`). An image whose stem an
    earlier one took gets its position first (`000012_<stem>.txt`)."""

    def __init__(self, folder: Path):
        self.folder, self.taken = folder, set[str]()
        folder.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        stem = Path(record["file"].partition("#")[0]).stem
        if "#" in record["file"]:  # a video's frame
            stem += f"_frame{record['file'].partition('#')[2]}"
        name = stem if stem not in self.taken else f"{record['index']:06d}_{stem}"
        self.taken.add(name)
        width, height = record["width"], record["height"]
        rows = []
        for d in record["detections"]:
            x0, y0, x1, y1 = d["box"]
            cx, cy = (x0 + x1) / 2 / width, (y0 + y1) / 2 / height
            w, h = (x1 - x0) / width, (y1 - y0) / height
            rows.append(f"{d['label'] - 1} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f} {d['score']:.5f}\n")
        (self.folder / f"{name}.txt").write_text("".join(rows))


class _atomic:
    """A file written under a temporary name and renamed into place when complete."""

    def __init__(self, path: Path, **kw):
        self.path, self.tmp, self.kw = path, path.with_name(path.name + ".tmp"), kw

    def __enter__(self):
        self.file = open(self.tmp, "w", **self.kw)
        return self.file

    def __exit__(self, kind, *_):
        self.file.close()
        if kind is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


class _Unreadable:
    """unreadable.txt: `file: reason` of each skipped item (absent when none was)."""

    def __init__(self, out: Path):
        self.path, self.count = out / "unreadable.txt", 0
        self.file: Optional[TextIO] = None

    def __enter__(self):
        return self

    def add(self, record: dict) -> None:
        if self.file is None:
            self.file = open(self.path, "w")
        self.count += 1
        self.file.write(f"{record['file']}: {record['error']}\n")

    def __exit__(self, *_):
        if self.file is not None:
            self.file.close()
        else:
            self.path.unlink(missing_ok=True)


# -- drawing ---------------------------------------------------------------------------------------


def drawn_name(index: int, name: str) -> str:
    """The drawn image's file name: the item's position first (names from different folders never
    collide), then its folder's and its own name (`000012_cat_0042.jpg`)."""
    base, _, frame = name.partition("#")  # a video's frame: <video>#<frame number>
    parts = Path(base).with_suffix("").parts[-2:]
    stem = "_".join(p for p in parts if p not in ("/", "..", "."))
    return f"{index:06d}_{stem}{'_frame' + frame if frame else ''}.jpg"


def draw(image: np.ndarray, result: dict[str, Any]) -> np.ndarray:
    """An upright RGB image with its result drawn, at the image's own size: boxes, class names,
    scores and masks (torchvision's drawing utilities; the labels' font, matplotlib's DejaVu Sans,
    scaled to the image), or a classifier's top labels as a caption."""
    # tools/predict.py's launching process reads this module (the manifest) without torchvision
    from torchvision.utils import (  # noqa: PLC0415 (torchvision: 2 s)
        draw_bounding_boxes,
        draw_segmentation_masks,
    )

    tensor = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)
    if "top" in result:
        return _caption(image, "  ".join(f"{t['name']} {t['prob']:.2f}" for t in result["top"][:3]))
    found = result["detections"]
    if not found:
        return image
    colours = [_colour(d["label"]) for d in found]
    masks = [d["mask"] for d in found if "mask" in d]
    if masks and len(masks) == len(found):
        stacked = torch.from_numpy(decode(masks, image.shape[0], image.shape[1]).astype(bool))
        tensor = draw_segmentation_masks(tensor, stacked, alpha=0.45, colors=colours)
    boxes = torch.tensor([d["box"] for d in found], dtype=torch.float32)
    side = max(image.shape[:2])
    font = _label_font()
    tensor = draw_bounding_boxes(
        tensor,
        boxes,
        labels=[f"{d['name']} {d['score']:.2f}" for d in found],
        colors=colours,
        width=max(1, round(side / 300)),
        # a 640-px image: 16 px letters; a thumbnail's as small as they stay readable
        font=font,
        font_size=max(7, round(side / 40)) if font else None,
        # on the box's colour, black or white by its brightness: legible on any photo
        fill_labels=True,
        label_colors=[
            "black" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "white" for r, g, b in colours
        ],
    )
    return tensor.permute(1, 2, 0).numpy()


@functools.lru_cache(maxsize=1)
def _label_font() -> Optional[str]:
    """matplotlib's DejaVu Sans (a dependency: the plots), a font torchvision scales; None (its
    fixed bitmap font) where it is not there."""
    try:
        import matplotlib  # noqa: PLC0415 (the plots' library: read once, when drawing)
    except ImportError:
        return None
    path = Path(matplotlib.__file__).parent / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf"
    return str(path) if path.is_file() else None


# what a drawn image may be written as (OpenCV's encoders); anything else is refused
DRAWN_FORMATS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")


def save_drawn(path: Path, image: np.ndarray) -> None:
    """An RGB image written in the format of `path`'s extension (JPEG at quality 90; PNG
    lossless), under a temporary name first, so the file is whole or absent."""
    suffix = path.suffix.lower()
    if suffix not in DRAWN_FORMATS:
        raise ValueError(
            f"{path}: a drawn image is written as one of {', '.join(DRAWN_FORMATS)}: name the "
            "file with one of them"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{suffix}")
    quality = [cv2.IMWRITE_JPEG_QUALITY, 90] if suffix in (".jpg", ".jpeg") else []
    if not cv2.imwrite(str(tmp), cv2.cvtColor(image, cv2.COLOR_RGB2BGR), quality):
        raise OSError(f"could not write {path}")
    os.replace(tmp, path)


def _caption(image: np.ndarray, text: str) -> np.ndarray:
    out = np.ascontiguousarray(image).copy()
    scale = max(0.4, out.shape[1] / 640)
    (w, h), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)
    cv2.rectangle(out, (0, 0), (min(out.shape[1], w + 8), h + base + 8), (0, 0, 0), thickness=-1)
    cv2.putText(
        out, text, (4, h + 4), cv2.FONT_HERSHEY_SIMPLEX, scale, (255, 255, 255), 1, cv2.LINE_AA
    )
    return out


def _colour(label: int) -> tuple[int, int, int]:
    """A fixed, distinct colour per label (the golden-ratio walk round the hue circle)."""
    r, g, b = colorsys.hsv_to_rgb((label * 0.618034) % 1.0, 0.85, 0.95)
    return int(r * 255), int(g * 255), int(b * 255)


def write_video(
    records: Iterable[dict], video: str, frames: list[int], fps: float, path: Path
) -> int:
    """The video's predicted frames with their results drawn, at its frame rate over the stride; the
    frames count."""
    stride = frames[1] - frames[0] if len(frames) > 1 else 1
    reader, writer, written = VideoFrames(video), None, 0
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    try:
        for r in records:
            if "error" in r:
                continue
            image = draw(reader.read(frames[r["index"]]), r)
            if writer is None:
                writer = cv2.VideoWriter(
                    str(tmp),
                    cv2.VideoWriter.fourcc(*"mp4v"),
                    max(fps / stride, 1.0),
                    (image.shape[1], image.shape[0]),
                )
            writer.write(cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
            written += 1
    finally:
        reader.close()
        if writer is not None:
            writer.release()
    if written:
        os.replace(tmp, path)
    return written


def read_manifest(out: Path) -> Optional[dict[str, Any]]:
    path = out / MANIFEST
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def write_manifest(out: Path, manifest: dict[str, Any]) -> None:
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out / MANIFEST)
