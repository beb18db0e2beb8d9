"""Exact distributed COCO evaluation: boxes (`bbox`) and, for models with a mask head, masks
(`segm`) from one pass.

Each data-parallel rank predicts its shard (every val image exactly once over the ranks); a
predicted mask is thresholded at 0.5 and encoded to an RLE on the rank that predicted it
(pycocotools' mask API), so only compact runs travel. Detections travel to global rank 0 as compact
arrays (with their RLEs) over the DP group, are de-duplicated by image id, their image count is
checked against the val set, and they are scored by COCOeval: faster-coco-eval when installed (the
same numbers, several times faster), pycocotools otherwise. While rank 0 scores, the other ranks
wait in a single broadcast that carries the result, or the error, back to them: nobody is left in a
collective that could time out or hang.
"""

from __future__ import annotations

import json
import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from visiondist.data.masks import encode
from visiondist.data.transforms import unit_float
from visiondist.data.workers import watched
from visiondist.evaluation.coco_scoring import (
    backend_name,
    score,
    segm_results,
    to_results_json,
)
from visiondist.models.detection import has_mask_head
from visiondist.observe.progress import status, tracked

log = logging.getLogger(__name__)

# a pixel belongs to a predicted instance where its mask probability is above this (torchvision's)
MASK_THRESHOLD = 0.5


def _masks_of(output: dict) -> list[dict]:
    """The RLEs of one image's predicted masks (probabilities (n, 1, H, W) at the image's size),
    thresholded."""
    return encode((output["masks"][:, 0] > MASK_THRESHOLD).cpu().numpy())


@torch.no_grad()
def predict(
    model: nn.Module,
    loader,
    device: torch.device,
    cat_of_label: dict[int, int],
    autocast: Optional[AbstractContextManager] = None,
    progress: bool = False,
) -> tuple[np.ndarray, list[int], Optional[list[dict]]]:
    """A detector's detections of this rank's share of the val set.

    Detections of this rank's shard as (n, 7) rows (image_id, x, y, w, h, score, category_id),
    the ids of the images it saw (with or without detections) and, for a model that predicts masks,
    an RLE per row (else None); `progress`: a progress bar over the batches.

    Args:
        model: a torchvision-interface detector.
        loader: this rank's val batches (lists of uint8 images and targets).
        device: the model's device.
        cat_of_label: the COCO category id of each label.
        autocast: the forward's autocast context; None: none.
        progress: a progress bar over the batches.
    """
    was_training = model.training
    model.eval()
    rows, seen = [], []
    rles: Optional[list[dict]] = [] if has_mask_head(model) else None  # one per row: mask models
    for images, targets in tracked(watched(iter(loader)), progress, total=len(loader)):
        images = unit_float(images, device)
        with autocast or nullcontext():
            outputs = model(images)
        for output, target in zip(outputs, targets):
            image_id = int(target["image_id"])
            seen.append(image_id)
            boxes = output["boxes"].float().cpu().numpy()
            if len(boxes) == 0:
                continue
            xywh = np.concatenate([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], axis=1)
            cats = np.array(
                [cat_of_label[int(label)] for label in output["labels"].cpu()], dtype=np.float64
            )
            scores = output["scores"].float().cpu().numpy()
            rows.append(np.column_stack([np.full(len(boxes), image_id), xywh, scores, cats]))
            if "masks" in output:
                rles = rles if rles is not None else []  # a stand-in model without roi_heads
                rles.extend(_masks_of(output))
    model.train(was_training)
    detections = np.concatenate(rows) if rows else np.zeros((0, 7))
    return detections, seen, rles


# one rank's (detections, ids of the images it saw, RLEs)
Part = tuple[np.ndarray, list[int], Optional[list[dict]]]


def gather_detections(
    detections: np.ndarray, seen: list[int], layout, rles: Optional[list[dict]] = None
) -> Optional[list[Part]]:
    """Every DP rank's part, on DP-rank 0 of the group (None elsewhere). TP / PP peers hold the same
    predictions; each DP group gathers its own and only global rank 0 goes on to score.

    Args:
        detections: this rank's (n, 7) rows (`predict`).
        seen: the ids of the images it saw.
        layout: this rank's `Layout` (its DP group).
        rles: an RLE per row (mask models), else None.
    """
    if layout.dp == 1:
        return [(detections, seen, rles)]
    parts: Optional[list] = [None] * layout.dp if layout.dp_rank == 0 else None
    group = layout.dp_group
    dist.gather_object(
        (detections, seen, rles), parts, dst=dist.get_global_rank(group, 0), group=group
    )
    return parts


def deduplicate(parts: list[Part], expected: int) -> tuple[np.ndarray, int, Optional[list[dict]]]:
    """One report per image (the first part that saw it wins); every val image must have been seen.
    Returns the detections, the image count and (mask models) the detections' RLEs.

    Args:
        parts: every rank's (detections, seen image ids, RLEs).
        expected: the val set's image count (a RuntimeError otherwise).
    """
    taken: set[int] = set()
    keep: list[np.ndarray] = []
    keep_rles: Optional[list[dict]] = None
    for detections, seen, *rest in parts:
        rles = rest[0] if rest else None
        if rles is not None and keep_rles is None:
            keep_rles = []
        new = set(seen) - taken
        if new:
            mine = np.isin(detections[:, 0], list(new))
            keep.append(detections[mine])
            if rles is not None and keep_rles is not None:  # (the latter follows from the former)
                keep_rles.extend(rle for rle, kept in zip(rles, mine) if kept)
        taken |= new
    if len(taken) != expected:
        raise RuntimeError(f"COCO evaluation saw {len(taken)} distinct images, expected {expected}")
    return (np.concatenate(keep) if keep else np.zeros((0, 7))), len(taken), keep_rles


def evaluate_detection(
    model: nn.Module,
    loader,
    layout,
    ann_file: str | Path,
    cat_of_label: dict[int, int],
    num_images: int,
    autocast: Optional[AbstractContextManager] = None,
    results_path: Optional[Path] = None,
    progress: bool = False,
) -> dict[str, Any]:
    """A detector's exact COCO mAP over every rank's share of the val set, on every rank.

    The 12 COCO box stats (as `val_<name>`, plus val_count and val_detections) of `model` on the
    val set and, for a model that predicts masks, the 12 mask stats of the same detections
    (`val_segm_<name>`), on every rank. Rank 0 also writes `results_path` (COCO results JSON of the
    boxes) when given, and `segmentations.json` beside it (of the masks). `progress` (main rank): a
    progress bar over the batches, then a spinner while COCOeval scores.

    Args:
        model: a torchvision-interface detector.
        loader: this rank's val batches.
        layout: this rank's `Layout` (device, ranks, the DP group).
        ann_file: the val split's COCO annotation file.
        cat_of_label: the COCO category id of each label.
        num_images: the val set's image count (every one must be seen).
        autocast: the forward's autocast context; None: none.
        results_path: where rank 0 writes the detections as COCO results; None: not written.
        progress: a progress bar, then a spinner.

    Returns:
        The metrics by name (`val_class_AP`, `val_segm_class_AP`: AP by category name).
    """
    detections, seen, rles = predict(model, loader, layout.device, cat_of_label, autocast, progress)
    gathered = gather_detections(detections, seen, layout, rles)
    box: list[Any] = [None]
    if layout.rank == 0:
        try:
            assert gathered is not None  # global rank 0 is DP-rank 0 of its group
            box[0] = _score_gathered(gathered, ann_file, num_images, results_path, progress)
        except Exception as exc:  # every rank must learn of it, not wait forever
            box[0] = exc
    if layout.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]


def _score_gathered(
    gathered: list[Part],
    ann_file: str | Path,
    num_images: int,
    results_path: Optional[Path],
    progress: bool,
) -> dict[str, Any]:
    """Rank 0: every part de-duplicated, scored (boxes, then masks), the results files written."""
    dets, count, rles = deduplicate(gathered, expected=num_images)
    what = "detections" if rles is None else "detections and masks"
    with status(
        progress, f"COCO scoring of {len(dets)} {what} on {count} images ({backend_name()})"
    ):
        stats = {f"val_{k}": v for k, v in score(ann_file, dets, per_class=True).items()}
        if rles is not None:
            stats.update(
                {
                    f"val_segm_{k}": v
                    for k, v in score(ann_file, dets, per_class=True, segmentations=rles).items()
                }
            )
    if results_path is not None:
        _write_json(results_path, to_results_json(dets))
        if rles is not None:
            _write_json(results_path.with_name("segmentations.json"), segm_results(dets, rles))
    return {**stats, "val_count": count, "val_detections": len(dets)}


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)
