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

import contextlib
import io
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
from visiondist.models.detection import has_mask_head
from visiondist.observe.progress import status, tracked

log = logging.getLogger(__name__)

# a pixel belongs to a predicted instance where its mask probability is above this (torchvision's)
MASK_THRESHOLD = 0.5
STAT_NAMES = (
    "mAP",
    "AP50",
    "AP75",
    "APs",
    "APm",
    "APl",
    "AR1",
    "AR10",
    "AR100",
    "ARs",
    "ARm",
    "ARl",
)
_SUMMARY_LINES = (
    "Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]",
    "Average Precision  (AP) @[ IoU=0.50      | area=   all | maxDets=100 ]",
    "Average Precision  (AP) @[ IoU=0.75      | area=   all | maxDets=100 ]",
    "Average Precision  (AP) @[ IoU=0.50:0.95 | area= small | maxDets=100 ]",
    "Average Precision  (AP) @[ IoU=0.50:0.95 | area=medium | maxDets=100 ]",
    "Average Precision  (AP) @[ IoU=0.50:0.95 | area= large | maxDets=100 ]",
    "Average Recall     (AR) @[ IoU=0.50:0.95 | area=   all | maxDets=  1 ]",
    "Average Recall     (AR) @[ IoU=0.50:0.95 | area=   all | maxDets= 10 ]",
    "Average Recall     (AR) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]",
    "Average Recall     (AR) @[ IoU=0.50:0.95 | area= small | maxDets=100 ]",
    "Average Recall     (AR) @[ IoU=0.50:0.95 | area=medium | maxDets=100 ]",
    "Average Recall     (AR) @[ IoU=0.50:0.95 | area= large | maxDets=100 ]",
)


def summary_lines(stats: dict[str, float]) -> str:
    """The 12-line COCOeval summary, as pycocotools prints it.

    Args:
        stats: the 12 stats by name (`STAT_NAMES`).
    """
    return "\n".join(
        f" {line} = {stats[name]:0.3f}" for line, name in zip(_SUMMARY_LINES, STAT_NAMES)
    )


def backend_name() -> str:
    """The COCO scorer here: "faster-coco-eval" when it is installed, else "pycocotools"."""
    try:
        import faster_coco_eval  # noqa: F401,PLC0415 (a probe: pycocotools without it)

        return "faster-coco-eval"
    except ImportError:
        return "pycocotools"


# the annotation files whose ids were renumbered, said once each
_RENUMBERED: set[str] = set()


def ground_truth(ann_file: str | Path) -> dict[str, Any]:
    """The val split's COCO annotations for scoring, their ids made 1, 2, ... where the file's are
    not positive and unique: COCOeval marks a detection's match with its annotation's id and reads
    0 as unmatched, so an annotation numbered 0 (Label Studio's and other tools' exports count from
    0) would score its match as a miss."""
    data = json.loads(Path(ann_file).read_text())
    annotations = data.get("annotations", [])
    ids = [a.get("id") for a in annotations]
    if all(isinstance(i, int) and i > 0 for i in ids) and len(set(ids)) == len(ids):
        return data
    for k, annotation in enumerate(annotations, 1):
        annotation["id"] = k
    if str(ann_file) not in _RENUMBERED:
        _RENUMBERED.add(str(ann_file))
        log.info(
            "%s: its %d annotation ids scored as 1-%d (they %s; COCO's scoring reads id 0 as "
            "unmatched)",
            ann_file,
            len(annotations),
            len(annotations),
            "repeat" if len(set(ids)) != len(ids) else "are not all positive whole numbers",
        )
    return data


def score(
    ann_file: str | Path,
    detections: np.ndarray,
    backend: Optional[str] = None,
    per_class: bool = False,
    segmentations: Optional[list[dict]] = None,
) -> dict[str, Any]:
    """The 12 COCOeval box stats of `detections` (rows: image_id, x, y, w, h, score, category_id)
    against `ann_file`; with `segmentations` (an RLE per row), the 12 mask stats of the same
    detections instead. No detection at all scores 0 everywhere (COCOeval cannot load an empty
    result list). `per_class` adds `class_AP`: {category name: AP@[.5:.95] over all areas, up to 100
    detections; None without ground truth}.

    Args:
        ann_file: the ground truth, a COCO annotation file.
        detections: (n, 7) rows: image_id, x, y, w, h, score, category_id.
        backend: "faster-coco-eval" or "pycocotools"; None: `backend_name()`.
        per_class: add each category's AP (`class_AP`).
        segmentations: an RLE per detection: score the masks instead of the boxes.

    Returns:
        The 12 stats by name (`STAT_NAMES`), and `class_AP` when asked.
    """
    backend = backend or backend_name()
    if len(detections) == 0:
        zeros: dict[str, Any] = {name: 0.0 for name in STAT_NAMES}
        if per_class:
            zeros["class_AP"] = {
                c["name"]: 0.0 for c in json.loads(Path(ann_file).read_text())["categories"]
            }
        return zeros
    # one backend's classes under the same names, imported as asked (faster-coco-eval may be absent)
    if backend == "faster-coco-eval":
        from faster_coco_eval import COCO  # noqa: PLC0415 (by backend)
        from faster_coco_eval import COCOeval_faster as COCOeval  # noqa: PLC0415 (by backend)
    elif backend == "pycocotools":
        from pycocotools.coco import COCO  # noqa: PLC0415 (by backend)
        from pycocotools.cocoeval import COCOeval  # noqa: PLC0415 (by backend)
    else:
        raise ValueError(
            f"unknown COCO scoring backend {backend!r}: faster-coco-eval or pycocotools"
        )
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = ground_truth(ann_file)
        gt.createIndex()
        if segmentations is None:
            evaluator = COCOeval(
                gt, gt.loadRes(np.asarray(detections, dtype=np.float64)), iouType="bbox"
            )
        else:
            evaluator = COCOeval(
                gt, gt.loadRes(segm_results(detections, segmentations)), iouType="segm"
            )
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    stats: dict[str, Any] = {
        name: float(v) for name, v in zip(STAT_NAMES, list(evaluator.stats)[:12])
    }
    if per_class:
        stats["class_AP"] = _class_ap(evaluator, gt)
    return stats


def _class_ap(evaluator, gt) -> dict[str, Optional[float]]:
    """Per category: the mean precision over IoU thresholds and recall points (area all, the last
    max-detections setting), as COCOeval's summary computes AP for all categories together."""
    # [iou, recall, category, area, max detections]
    precision = np.asarray(evaluator.eval["precision"])
    names = {c["id"]: c["name"] for c in gt.loadCats(gt.getCatIds())}
    result: dict[str, Optional[float]] = {}
    for k, cat_id in enumerate(evaluator.params.catIds):
        values = precision[:, :, k, 0, -1]
        values = values[values > -1]
        result[names[cat_id]] = float(values.mean()) if values.size else None
    return result


def to_results_json(detections: np.ndarray) -> list[dict[str, Any]]:
    """COCO results format (what `loadRes` and the evaluation server read), at full precision so
    that scoring the file gives exactly the stats scored in memory.

    Args:
        detections: (n, 7) rows: image_id, x, y, w, h, score, category_id.
    """
    return [
        {
            "image_id": int(d[0]),
            "category_id": int(d[6]),
            "bbox": [float(v) for v in d[1:5]],
            "score": float(d[5]),
        }
        for d in detections
    ]


def segm_results(detections: np.ndarray, segmentations: list[dict]) -> list[dict[str, Any]]:
    """COCO's results format for masks: each detection's image, category, score and RLE.

    Args:
        detections: (n, 7) rows: image_id, x, y, w, h, score, category_id.
        segmentations: an RLE per row.
    """
    return [
        {"image_id": int(d[0]), "category_id": int(d[6]), "segmentation": rle, "score": float(d[5])}
        for d, rle in zip(detections, segmentations)
    ]


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
