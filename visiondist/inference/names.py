"""What a model's outputs are called (`Names`), read where the weights record them (a checkpoint's
trainer state, an export's metadata or sidecar, a from_pretrained directory's config.json), else
from the run's data (class folders, a packed set, the annotation file), else numbered; the class
count a prediction takes from them; and `predict.classes` turned into a detector's labels.

The launching process reads this module before its ranks start; a COCO file's names come from
its `categories` alone (`visiondist.preflight.images.coco_categories`), not a parse of the whole
file."""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError, safe_open

from visiondist.checkpoint.files import read_trainer_state
from visiondist.config import ConfigError
from visiondist.data.formats.exports import coco_paths
from visiondist.data.index import list_image_folder
from visiondist.data.shards import open_store, read_meta
from visiondist.models import TASKS
from visiondist.models.exported import program_info
from visiondist.preflight.images import coco_categories
from visiondist.utils.dcp import is_complete

log = logging.getLogger(__name__)


@dataclass
class Names:
    """What the model's outputs are called: a classifier's logits 0..K-1, or a detector's labels
    1..K (with the COCO category id each stands for), and where the names were read."""

    classes: list[str]
    categories: Optional[list[int]]  # detectors: label k -> categories[k - 1]
    read_from: str


def kept_labels(wanted: list[str], names: Names) -> list[int]:
    """The detector labels of `predict.classes` (class names, or COCO category ids); ConfigError
    naming the model's classes when one is not among them."""
    out = []
    for value in wanted:
        value = str(value)
        if value in names.classes:
            out.append(names.classes.index(value) + 1)
        elif value.isdigit() and names.categories and int(value) in names.categories:
            out.append(names.categories.index(int(value)) + 1)
        else:
            ids = (
                f" (COCO category ids {', '.join(map(str, names.categories))})"
                if names.categories
                else ""
            )
            close = difflib.get_close_matches(value, names.classes, n=1, cutoff=0.6)
            mean = f"did you mean classes={close[0]}? " if close else ""
            raise ConfigError(
                f"classes={value}: {mean}this model was trained for {', '.join(names.classes)}"
                f"{ids}: give some of those"
            )
    return out


def read_names(cfg: DictConfig) -> Names:
    """The names of the model's outputs: what its weights record (a checkpoint's trainer state, an
    export's metadata or sidecar, a from_pretrained directory's config.json), else the run's data
    (class folders, the annotation file), else `class <k>`.

    Args:
        cfg: the prediction's config (`model.weights`, the model and its data).

    Returns:
        The `Names` (with the COCO category ids of a detector's labels where known).
    """
    k = int(cfg.model.num_classes)
    detector = TASKS[cfg.model.family] == "detection"
    weights = Path(cfg.model.weights) if cfg.model.weights else None
    recorded = recorded_names(weights) if weights is not None else None
    if recorded is not None and recorded.classes and (not detector or recorded.categories):
        return recorded
    from_data = data_names(cfg)
    if from_data is not None and len(from_data.classes) == k:
        # names from the weights, category ids from the data
        if recorded is not None and recorded.classes:
            return Names(
                recorded.classes,
                from_data.categories,
                f"{recorded.read_from} and {from_data.read_from}",
            )
        return from_data
    if recorded is not None and recorded.classes:
        return recorded
    log.warning(
        "the weights record no class names and the run's data is not here: classes are called "
        "class 0.. class %d",
        k - 1,
    )
    classes = [f"class {i}" for i in range(k)]
    return Names(classes, None, "nowhere (numbered)")


def check_same_classes(cfg: DictConfig, key: str = "weights") -> None:
    """The classes the weights record (`recorded_names`) are the data's, in the same order, where
    both are known: evaluated on other classes (another set with as many), every label would be
    scored against another class's name, a top-1 of 0 with nothing said. ConfigError naming both."""
    weights = Path(str(cfg.model.weights)) if cfg.model.weights else None
    recorded = recorded_names(weights) if weights is not None and weights.exists() else None
    if recorded is None or not recorded.classes:
        return
    data = data_names(cfg)
    if data is None or data.classes == recorded.classes:
        return
    if sorted(data.classes) == sorted(recorded.classes) and data.categories is not None:
        # a detection set's order is its own: where each format takes it from
        how, fix = (
            "the same classes in another order",
            "list them in the trained order (a YOLO set's data.yaml `names:`, a VOC set's "
            "labelmap.txt, else VOC sorts them; a COCO file's category ids), or train on this data",
        )
    else:
        same = sorted(data.classes) == sorted(recorded.classes)
        how, fix = (
            "the same classes in another order" if same else f"classes {_some(data.classes)}",
            "evaluate on data with the classes it was trained for (data.root=...), or train on "
            "this data",
        )
    raise ConfigError(
        f"{key}={weights} was trained on classes {_some(recorded.classes)}, but "
        f"{data.read_from} holds {how}: {fix}"
    )


def _some(names: list[str], shown: int = 6) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def count_classes(cfg: DictConfig, weights: Path) -> None:
    """A class count no override gave (prediction reads no data to count it): from the names the
    weights record (tools/export.py's files, a checkpoint), set in `cfg`; else a one-line refusal
    naming the key."""
    if not OmegaConf.is_missing(cfg.data, "num_classes"):
        return
    names = recorded_names(weights)
    if names is None or not names.classes:
        raise ConfigError(
            f"weights={weights} records no class names: give the class count it was trained for, "
            "data.num_classes=<N>"
        )
    cfg.data.num_classes = len(names.classes)
    if OmegaConf.is_missing(cfg.model, "num_classes"):
        cfg.model.num_classes = len(names.classes)


def recorded_names(weights: Path) -> Optional[Names]:
    """The class names `weights` record (a checkpoint's trainer state, an export's metadata or
    sidecar, a from_pretrained directory's config.json), or None."""
    try:
        if is_complete(weights):
            state = read_trainer_state(weights)
            return (
                Names(list(state["classes"]), state.get("category_ids"), f"{weights}")
                if state.get("classes")
                else None
            )
        if weights.is_dir() and (weights / "config.json").is_file():  # a from_pretrained directory
            config = json.loads((weights / "config.json").read_text())
            labels = config.get("id2label") or {}
            classes = [labels[key] for key in sorted(labels, key=int)] if labels else []
            cats = config.get("category_ids")
            return (
                Names(classes, list(cats) if cats else None, str(weights / "config.json"))
                if classes
                else None
            )
        meta = _file_metadata(weights)
        if "labels" in meta:
            labels = json.loads(meta["labels"])
            order = sorted(labels, key=int)
            return Names(
                [labels[k]["name"] for k in order],
                [int(labels[k]["category_id"]) for k in order],
                str(weights),
            )
        if "classes" in meta:
            return Names(list(json.loads(meta["classes"])), None, str(weights))
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        log.warning("%s: its recorded class names cannot be read (%s)", weights, exc)
    return None


def _file_metadata(weights: Path) -> dict[str, str]:
    """A .safetensors or .onnx file's own metadata, else its sidecar `<stem>.json` (tools/export.py
    writes both)."""
    meta: dict[str, str] = {}
    if weights.suffix == ".safetensors":
        with safe_open(str(weights), framework="pt") as f:
            meta = dict(f.metadata() or {})
    elif weights.suffix == ".pt2":  # tools/export.py's program: its visiondist.json
        info = program_info(weights) or {}
        meta = {"classes": json.dumps(info["classes"])} if info.get("classes") else {}
    elif weights.suffix == ".onnx":
        import onnx  # noqa: PLC0415 (onnx: the export extra)

        proto = onnx.load(str(weights), load_external_data=False)
        meta = {p.key: p.value for p in proto.metadata_props}
    sidecar = weights.with_suffix(".json")
    if not meta and sidecar.is_file():
        info = json.loads(sidecar.read_text())
        if info.get("labels"):
            meta["labels"] = json.dumps(info["labels"])
        elif info.get("classes"):
            meta["classes"] = json.dumps(info["classes"])
    return meta


def data_names(cfg: DictConfig) -> Optional[Names]:
    """The run's class folders (or its packed set's classes), or its val annotation file's
    categories; None when the data is not here."""
    d = cfg.data
    try:
        if TASKS[cfg.model.family] == "detection":
            # the file's categories alone (not its images and annotations), labels 1..K in the
            # order of their ids, as the COCO loader numbers them
            _, annotations = coco_paths(d, d.val_split)
            found = sorted(coco_categories(annotations), key=lambda c: c["id"])
            names = [str(c["name"]) for c in found]
            cats = [int(c["id"]) for c in found]
            return Names(names, cats, f"the annotations of {d.root}") if names else None
        if d.get("format") == "shards":
            return Names(list(read_meta(open_store(d))["classes"]), None, "the run's packed set")

        root = Path(str(d.root)).expanduser()
        for split in (d.val_split, d.train_split):
            if (root / split).is_dir():
                classes, _, _ = list_image_folder(root / split, cache=False)
                return Names(list(classes), None, f"the class folders of {root / split}")
    except Exception as exc:  # the data is someone else's machine's: numbered names, said once
        log.debug("no class names from the run's data: %s", exc)
    return None
