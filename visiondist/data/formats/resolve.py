"""A user's detection data recognised from `data.root` alone, and read as COCO by everything after.

`recognise` names the format of a folder: a YOLO set (a data.yaml), a Pascal VOC set (Annotations/
and JPEGImages/), or a COCO-format tree in one of the layouts annotation tools export
(`exports.py`). `resolve_detection` then fills the data config in the launching process, before
any rank starts: a COCO tree gets its `images` / `annotations` patterns; a YOLO or VOC split is
indexed as COCO ground truth (`labels.py`) into the user's cache, and the config points at it
(`data.annotations` an absolute path, `data.images` the folder the images' names are relative to).

The index of a split is reused while its inputs are unchanged (`index_cache.py`).
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from visiondist.config import ConfigError
from visiondist.data.formats.exports import (
    coco_classes,
    find_layout,
    group_of,
    read_coco,
    ungrouped,
)
from visiondist.data.formats.index_cache import Recognised, cache_folder, cached_index, inputs_of
from visiondist.data.formats.labels import (
    Problem,
    SplitIndex,
    default_workers,
    index_voc,
    index_yolo,
    read_voc,
)
from visiondist.data.formats.voc import VocImage, class_names, find_root, split_ids
from visiondist.data.formats.yolo import YoloSet, find_yaml, list_images, read_yaml
from visiondist.data.shards.store import is_pack
from visiondist.utils.text import counted

log = logging.getLogger(__name__)

FORMATS = ("yolo", "voc", "coco")
NAMED = 10  # problems named in one line; the rest counted


def recognise(root: Path) -> Optional[Recognised]:
    """The detection format of `root`, or None when it is none of YOLO, VOC or a COCO layout."""
    yaml_file = find_yaml(root)
    if yaml_file is not None:
        return Recognised("yolo", yaml_file, f"a YOLO set ({yaml_file.name})")
    voc = find_root(root) if root.is_dir() else None
    if voc is not None:
        return Recognised("voc", voc, "a Pascal VOC set")
    layout = find_layout(root) if root.is_dir() else None
    if layout is not None:
        return Recognised("coco", root, f"COCO in {layout.name}'s layout", layout)
    return None


def _yolo_builders(
    recognised: Recognised, dataset: YoloSet, listed: dict[str, list[Path]], workers: int
):
    images = [i for s in listed for i in listed[s]]
    if not images:
        raise ConfigError(f"{recognised.root}: its {' and '.join(listed)} splits hold no image")
    image_root = Path(os.path.commonpath([str(i.parent) for i in images]))
    return {s: (lambda s=s: index_yolo(dataset, s, image_root, workers, listed[s])) for s in listed}


def _voc_builders(recognised: Recognised, splits: list[str], workers: int):
    """Each split's builder; the class names are those of every split asked for, so the first
    build reads them all (once)."""
    root = recognised.root

    @functools.cache
    def read() -> dict[str, list[VocImage | Problem]]:
        return {s: read_voc(root, split_ids(root, s), workers) for s in splits}

    def build(split: str) -> SplitIndex:
        found = {o.name for entries in read().values() for e in entries
                 if not isinstance(e, Problem) for o in e.objects}  # fmt: skip
        return index_voc(root, read()[split], class_names(root, found))

    return {s: (lambda s=s: build(s)) for s in splits}


def _split_keys(recognised: Recognised, d: DictConfig, purpose: str) -> list[tuple[str, str]]:
    """(the data config's key, the split's name in the set) of each split `purpose` reads."""
    keys = [("val_split", d.val_split)] if purpose == "eval" else [
        ("train_split", d.train_split), ("val_split", d.val_split)
    ]  # fmt: skip
    layout = recognised.layout
    if layout is None:
        return keys
    named = [(key, layout.split_name(split)) for key, split in keys]
    missing = [(key, split) for key, split in named if split not in layout.splits]
    if not missing:
        return named
    # an evaluation of an export of one split (CVAT names a task without subsets `default`)
    if purpose == "eval" and len(layout.splits) == 1:
        return [("val_split", layout.splits[0])]
    there, plural = ", ".join(layout.splits), "s" if len(layout.splits) > 1 else ""
    one = (
        " (an export of one split: training on it and evaluating on it scores the training "
        "images); or cut train and val from it: python tools/data.py split data=detection "
        f"data.root={recognised.root} val=0.2 out=<a new folder>"
        if len(layout.splits) == 1
        else ""
    )
    raise ConfigError(
        f"{recognised.root} is {recognised.what} with the split{plural} {there} "
        f"({layout.annotations.format(split='<split>')}), no "
        f"{' or '.join(split for _, split in missing)}: choose with "
        f"{' '.join(f'data.{key}=<one of {there}>' for key, _ in missing)}{one}"
    )


def _check_splits(recognised: Recognised, splits: list[str]) -> Optional[YoloSet]:
    if recognised.format != "yolo":
        for split in splits:
            split_ids(recognised.root, split)  # a missing split list: one line naming those there
        return None
    dataset = read_yaml(recognised.root)
    for split in splits:
        if split in dataset.missing:
            raise ConfigError(dataset.missing[split])
        if split not in dataset.splits:
            raise ConfigError(
                f"{recognised.root} has no `{split}:` split (it has "
                f"{', '.join(dataset.splits)}): add it, or choose with data.train_split= / "
                "data.val_split="
            )
    for line in dataset.missing.values():
        if line not in _SAID:  # once a process
            _SAID.add(line)
            log.warning(
                "%s: not read (this job reads %s)", line.split(": fix", 1)[0], " and ".join(splits)
            )
    return dataset


# the data.yaml lines of missing splits this process warned of
_SAID: set[str] = set()


def resolve_detection(d: DictConfig, purpose: str = "train") -> str:
    """Recognise the format of `data.root` (`data.format=auto`, or check it is the yolo / voc named)
    and fill the data config so that the COCO reader reads it: for YOLO and VOC, the splits indexed
    into the user's cache (built, or reused while unchanged). A val split with a bad label is
    refused; a train split's bad labels are left out and counted.

    Args:
        d: the data config (`data`), changed in place: format, images, annotations, the split
            names as the set names them, num_classes where unset.
        purpose: "train" (train and val splits) or "eval" (val).

    Returns:
        The start-up line: the format recognised, its counts, the index.

    Raises:
        ConfigError: a folder of no format known, a missing split, a bad val label, `names`
            shorter than the labels use, data.num_classes against the set's classes.
    """
    root = Path(d.root).expanduser()
    if not root.exists():
        raise ConfigError(f"data.root={d.root} does not exist")
    # the patterns below are the set's own paths (absolute): the readers join them to data.root,
    # which a relative data.root would then hold twice
    root = root.resolve()
    d.root = str(root)
    recognised = recognise(root)
    if recognised is None and is_pack(root):
        raise ConfigError(
            f"data.root={root} holds packed shards (tools/data.py pack): add data.format=shards"
        )
    if recognised is None and root.is_dir() and d.format in ("auto", "yolo"):
        # an Ultralytics yaml under its own name (coco128.yaml): given as the root, it is read
        yamls = sorted(p.name for p in root.glob("*.y*ml") if p.suffix in (".yaml", ".yml"))
        if yamls:
            raise ConfigError(
                f"{root} holds {', '.join(yamls[:3])} but no data.yaml: give the set's yaml as "
                f"the root, data.root={root / yamls[0]}"
            )
    if recognised is None or (d.format != "auto" and recognised.format != d.format):
        what = f"not {d.format} data" if d.format != "auto" else "of no format known"
        raise ConfigError(
            f"{root} is {what}: a YOLO set has a data.yaml, a Pascal VOC set Annotations/ and "
            "JPEGImages/, a COCO set annotations/instances_<split>.json, "
            "<split>/_annotations.coco.json or result.json beside images/ (docs/data.md, "
            '"Your own detection data")'
        )
    keys = _split_keys(recognised, d, purpose)
    for key, split in keys:
        d[key] = split
    layout = recognised.layout
    d.found = (
        f"coco ({layout.name})"
        if layout is not None and layout.name != "COCO"
        else recognised.format
    )
    if recognised.format == "coco":
        return _coco_layout(d, recognised, keys)
    splits = [split for _, split in keys]
    dataset = _check_splits(recognised, splits)
    workers = default_workers()
    listed = {s: list_images(dataset.splits[s]) for s in splits} if dataset is not None else {}
    builders = (
        _yolo_builders(recognised, dataset, listed, workers)
        if dataset is not None
        else _voc_builders(recognised, splits, workers)
    )
    parts = []
    names: list[str] = []
    for key, split in keys:
        inputs = inputs_of(recognised, split, listed.get(split))
        target, record = cached_index(recognised, split, builders[split], inputs)
        _refuse_or_count(record, split, val=key == "val_split", root=recognised.root)
        names = record["names"]
        parts.append(f"{split} {_counts_text(record['counts'])}")
        d.annotations = str(target.parent / "{split}.json")
        d.images = record["image_root"]
    _classes(d, names, recognised)
    return (
        f"data: {root} is {recognised.what}, {counted(len(names), 'classes')}; "
        + "; ".join(parts)
        + f" (index: {cache_folder(recognised)})"
    )


def _counts_text(counts: dict[str, int]) -> str:
    images, boxes = counts.get("images", 0), counts.get("boxes", 0)
    main = f"{counted(images, 'images')}, {counted(boxes, 'boxes')}"
    rest = [counted(n, what) for what, n in counts.items() if n and what not in ("images", "boxes")]
    return main + (f" ({', '.join(rest)})" if rest else "")


def _refuse_or_count(record: dict[str, Any], split: str, val: bool, root: Path) -> None:
    problems = [Problem(*p) for p in record["problems"]]
    if not problems:
        return
    unnamed = [p for p in problems if p.reason.startswith("class ")]
    if unnamed:  # every label of those classes would be lost: the names are short, not the labels
        raise ConfigError(
            f"{root}: names lists {len(record['names'])} classes but {len(unnamed)} label line"
            f"{'s' if len(unnamed) > 1 else ''} of the {split} split use"
            f"{'' if len(unnamed) > 1 else 's'} a class outside them ({unnamed[0]}): add the "
            "missing names (in class-index order), or fix those lines"
        )
    named = "; ".join(str(p) for p in problems[:NAMED])
    more = f" (and {len(problems) - NAMED} more)" if len(problems) > NAMED else ""
    if val:
        raise ConfigError(
            f"{root}: the {split} split has {len(problems)} label problem"
            f"{'s' if len(problems) > 1 else ''}, which an exact evaluation cannot leave out: "
            f"{named}{more}; fix or remove them"
        )
    log.warning(
        "%s: %d label problem%s in the %s split, left out of training: %s%s",
        root, len(problems), "s" if len(problems) > 1 else "", split, named, more,
    )  # fmt: skip


def _classes(d: DictConfig, names: list[str], recognised: Recognised) -> None:
    if OmegaConf.is_missing(d, "num_classes"):
        d.num_classes = len(names)
    elif d.num_classes != len(names):
        raise ConfigError(
            f"data.num_classes={d.num_classes} but {recognised.root} names {len(names)} classes: "
            f"drop data.num_classes (it is read from the data) or set it to {len(names)}"
        )


def _coco_layout(d: DictConfig, recognised: Recognised, keys: list[tuple[str, str]]) -> str:
    """A COCO tree in a tool's layout: its patterns, absolute, and each split's counts. A split
    whose categories hold a group name (Roboflow's category 0, the supercategory of every other,
    with no annotation of its own) is read from a copy in the cache without it, so that the classes
    are the labelled ones."""
    assert recognised.layout is not None
    root, layout = recognised.root, recognised.layout
    d.images = str(root / layout.images)
    d.annotations = str(root / layout.annotations)
    read = {split: read_coco(Path(d.annotations.format(split=split))) for _, split in keys}
    dropped = {split: group_of(coco) if coco else None for split, coco in read.items()}
    if any(dropped.values()):
        for _, split in keys:
            source = Path(str(root / layout.annotations).format(split=split))
            target, _ = cached_index(
                recognised, split, lambda source=source: ungrouped(source), [source]
            )
        d.annotations = str(target.parent / "{split}.json")
    names = next((n for n in dropped.values() if n), None)
    parts = [f"{split} {_coco_counts(coco)}" for split, coco in read.items() if coco]
    classes = next((coco_classes(c, dropped[s]) for s, c in read.items() if c), 0)
    return (
        f"data: {root} is {recognised.what}, {counted(classes, 'classes')}; "
        + ("; ".join(parts) or f"splits {', '.join(s for _, s in keys)}")
        + (f" (its category {names!r} names the group of the others: left out)" if names else "")
    )


def _coco_counts(coco: dict[str, Any]) -> str:
    """`120 images, 431 boxes` (and the crowd regions, which train nothing), as YOLO's and VOC's."""
    annotations = coco.get("annotations", [])
    crowd = sum(1 for a in annotations if a.get("iscrowd"))
    counts = {"images": len(coco.get("images", [])), "boxes": len(annotations) - crowd}
    return _counts_text({**counts, "crowd regions": crowd})
