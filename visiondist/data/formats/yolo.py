"""Ultralytics / YOLO detection folders: data.yaml, its splits, and its label files, read as
Ultralytics reads them.

- data.yaml: `path` (the set's root; relative to the yaml's folder, absent: that folder), `train`,
  `val`, optional `test` (each a folder of images, a .txt list of image paths, or a list of either;
  relative to `path`), `names` (a list, or a dict of class index -> name), optional `nc`.
- An image's label file: the image's path with its last `images` folder replaced by `labels` and its
  suffix by .txt. An image without one, or with an empty one, has no objects.
- A label line: `class cx cy w h` (a box, normalised to the image's width and height) or `class x1
  y1 x2 y2 ... xn yn` (a polygon, normalised; its box is its extent). Values a little outside [0, 1]
  (`ROUNDING`) are rounding and clipped; further out the line is refused, as is a class index
  outside `names`, a line of another length and a box of zero size.

Nothing here reads pixels: `labels.py` reads each image's size and turns the lines into pixels.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from visiondist.config import ConfigError
from visiondist.data.index import IMG_EXTENSIONS
from visiondist.utils.logs import warn_once

# Ultralytics' image suffixes (it reads more kinds than the ImageFolder reader)
YOLO_IMAGES = (*IMG_EXTENSIONS, ".dng", ".mpo", ".pfm")
ROUNDING = 1e-3  # normalised coordinates up to this far outside [0, 1] are clipped, not refused
YAML_NAMES = ("data.yaml", "dataset.yaml", "data.yml")


@dataclass(frozen=True)
class YoloSet:
    """A data.yaml read: its file, the set's root, each split's sources (folders or .txt lists, as
    absolute paths), and the class names in index order."""

    yaml_file: Path
    root: Path
    splits: dict[str, list[Path]]
    names: list[str]
    # a split named whose path is not there -> the line that says so: refused where it is read
    # (Roboflow names a `test:` it did not export; Ultralytics trains without it)
    missing: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LabelLine:
    """One object of a label file: its class index and, normalised to the image, its box
    (x1, y1, x2, y2) and polygon (x, y pairs; empty for a box line)."""

    label: int
    box: tuple[float, float, float, float]
    polygon: tuple[float, ...]
    clipped: bool  # a coordinate was outside [0, 1] by rounding and was clipped


def find_yaml(root: Path) -> Optional[Path]:
    """The data.yaml of a YOLO set: `root` itself when it is a yaml file, else the first of
    `YAML_NAMES` in it."""
    if root.is_file() and root.suffix in (".yaml", ".yml"):
        return root
    return next((root / n for n in YAML_NAMES if (root / n).is_file()), None)


def read_yaml(yaml_file: Path) -> YoloSet:
    """The YOLO set a data.yaml describes, checked: every split it names exists, `names` is there.

    Args:
        yaml_file: the data.yaml.

    Returns:
        The set, with absolute paths.

    Raises:
        ConfigError: a split that is missing or names nothing that exists, or no `names`.
    """
    try:
        spec = yaml.safe_load(yaml_file.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{yaml_file}: not a readable data.yaml ({exc})") from exc
    if not isinstance(spec, dict):
        raise ConfigError(f"{yaml_file}: a data.yaml is a mapping of path, train, val and names")
    root = Path(spec.get("path") or yaml_file.parent).expanduser()
    root = root if root.is_absolute() else (yaml_file.parent / root)
    if spec.get("path") and not root.is_dir():
        # written on another machine (Ultralytics' own datasets/ folder): every split is under it
        raise ConfigError(
            f"{yaml_file}: path: {spec['path']} does not exist: fix `path:`, or remove it to read "
            f"the splits from the yaml's folder, {yaml_file.parent}"
        )
    names = _names(spec, yaml_file)
    splits, absent = {}, {}
    for key in ("train", "val", "test"):
        value = spec.get(key)
        if value is None:
            continue
        sources = [_source(root, v) for v in (value if isinstance(value, list) else [value])]
        missing = [str(s) for s in sources if not s.exists()]
        if missing:
            read_from = "path:" if spec.get("path") else "the data.yaml's folder,"
            absent[key] = (
                f"{yaml_file}: {key}: {', '.join(missing)} does not exist: fix `{key}:` (relative "
                f"paths are read from {read_from} {root})"
            )
            continue
        splits[key] = sources
    if not {"train", "val"} & {*splits, *absent}:
        raise ConfigError(f"{yaml_file} names no train or val split: add `train:` and `val:`")
    return YoloSet(yaml_file, root.resolve(), splits, names, absent)


def _names(spec: dict[str, Any], yaml_file: Path) -> list[str]:
    names = spec.get("names")
    if isinstance(names, dict):
        keys = sorted(int(k) for k in names)
        if keys != list(range(len(keys))):
            raise ConfigError(
                f"{yaml_file}: names: the class indices are {keys}, not 0..{len(keys) - 1}: "
                "number the classes from 0 without gaps"
            )
        names = [names[k] if k in names else names[str(k)] for k in keys]
    if not isinstance(names, list) or not names:
        other = [str(k) for k in spec if str(k) != "names"]
        close = difflib.get_close_matches("names", other, n=1, cutoff=0.6) or [
            k for k in other if k.lower() in ("classes", "labels", "class_names")
        ]
        # the names under another key: the run, its weights and predictions would lose them
        if close:
            raise ConfigError(
                f"{yaml_file} has no names but a `{close[0]}:`: spell it `names:` (a list, or "
                "index: name)"
            )
        count = spec.get("nc")
        if isinstance(count, int) and count > 0:  # as Ultralytics names them
            # once, before any rank starts (the yaml is read again per split)
            warn_once(
                f"{yaml_file} has no names, only nc: {count}: the classes are called "
                f"class0..class{count - 1} (add `names:` to name them)"
            )
            return [f"class{i}" for i in range(count)]
        raise ConfigError(f"{yaml_file} has no names: add `names:` (a list, or index: name)")
    if "nc" in spec and spec["nc"] != len(names):
        raise ConfigError(
            f"{yaml_file}: nc is {spec['nc']} but names lists {len(names)} classes: make them agree"
        )
    return [str(n) for n in names]


def _source(root: Path, value: Any) -> Path:
    """A split's path; a relative one that starts with ../ and is not there is read without it, as
    Ultralytics reads it (Roboflow's YOLO exports write `train: ../train/images` beside a data.yaml
    at the set's top)."""
    text = str(value)
    path = Path(text).expanduser()
    if path.is_absolute():
        return path
    if not (root / path).exists() and text.startswith("../") and (root / text[3:]).exists():
        return root / text[3:]
    return root / path


def list_images(sources: list[Path]) -> list[Path]:
    """The images of a split, in a stable order: each folder's images found recursively (sorted),
    each .txt list's lines (relative lines read from the list's folder), in the order given."""
    images: list[Path] = []
    for source in sources:
        if source.is_dir():
            found = []
            for folder, _, files in os.walk(source):
                found += [os.path.join(folder, f) for f in files if f.lower().endswith(YOLO_IMAGES)]
            # Path's order (part by part), on the text
            images += [Path(f) for f in sorted(found, key=lambda f: f.split(os.sep))]
        else:
            for line in source.read_text().splitlines():
                line = line.strip()
                if line:
                    path = Path(line).expanduser()
                    images.append(path if path.is_absolute() else (source.parent / path))
    return images


def label_path(image: Path) -> Path:
    """The label file of `image`: its last `images` folder replaced by `labels`, suffix .txt."""
    return Path(label_file(str(image)))


def label_file(image: str) -> str:
    """`label_path` on a path's text (a set's index asks it of every image, three times)."""
    text, folder = image, f"{os.sep}images{os.sep}"
    at = text.rfind(folder)
    if at >= 0:
        text = f"{text[:at]}{os.sep}labels{os.sep}{text[at + len(folder) :]}"
    elif text.startswith(folder[1:]):
        text = f"labels{os.sep}{text[len(folder) - 1 :]}"
    return os.path.splitext(text)[0] + ".txt"


def parse_line(text: str, num_classes: int) -> LabelLine:
    """One label line, normalised coordinates checked (`ROUNDING`).

    Args:
        text: the line, stripped.
        num_classes: the length of `names`.

    Returns:
        The object it describes.

    Raises:
        ValueError: the line's fault in a few words (its caller names the file and line).
    """
    fields = text.split()
    if not (len(fields) == 5 or (len(fields) >= 7 and len(fields) % 2 == 1)):
        raise ValueError(
            f"{len(fields)} fields: a box is `class cx cy w h` (5), a polygon `class` and 3 or "
            "more x y pairs"
        )
    try:
        label_value = float(fields[0])
        values = [float(v) for v in fields[1:]]
    except ValueError:
        raise ValueError("a field is not a number") from None
    if not all(math.isfinite(v) for v in (label_value, *values)):
        raise ValueError("a field is not a finite number")
    if label_value != int(label_value) or not 0 <= label_value < num_classes:
        raise ValueError(f"class {fields[0]} is not one of names' 0..{num_classes - 1}")
    clipped = any(v < 0 or v > 1 for v in values)
    if any(v < -ROUNDING or v > 1 + ROUNDING for v in values):
        raise ValueError(
            "a coordinate is outside [0, 1]: YOLO labels are normalised to the image's size"
        )
    polygon: tuple[float, ...] = ()
    if len(values) == 4:
        cx, cy, w, h = values
        # a box past the image's edge is clipped to it (counted), as Ultralytics checks the four
        # fields and clips the corners, and as a COCO box is read
        box = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
        clipped = clipped or any(v < 0 or v > 1 for v in box)
    else:
        polygon = tuple(min(max(v, 0.0), 1.0) for v in values)
        xs, ys = polygon[0::2], polygon[1::2]
        box = (min(xs), min(ys), max(xs), max(ys))
    box = (
        min(max(box[0], 0.0), 1.0),
        min(max(box[1], 0.0), 1.0),
        min(max(box[2], 0.0), 1.0),
        min(max(box[3], 0.0), 1.0),
    )
    if box[2] <= box[0] or box[3] <= box[1]:
        raise ValueError("the box has zero width or height")
    return LabelLine(int(label_value), box, polygon, clipped)
