"""COCO scoring of detections in one process: COCOeval's 12 stats (faster-coco-eval when installed,
the same numbers several times faster; pycocotools otherwise), per-category AP, and the results
files COCO's tools read. The ground truth's annotation ids are made positive and unique where a
tool's export numbers them from 0 (`ground_truth`): COCOeval reads id 0 as no match.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np

from visiondist.utils.logs import held_at, said_before

log = logging.getLogger(__name__)

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
    0) would score its match as a miss. Said once a file, unless the job said it before launch.
    Polygons written as [x, y] points or unwrapped are read in COCO's form, as training reads them
    (`data.masks.coco_polygons`)."""
    from visiondist.data.coco_records import renumbering_line  # noqa: PLC0415 (pycocotools)
    from visiondist.data.masks import coco_polygons  # noqa: PLC0415 (pycocotools)

    data = json.loads(Path(ann_file).read_text())
    annotations = data.get("annotations", [])
    for annotation in annotations:
        if isinstance(annotation.get("segmentation"), list):
            annotation["segmentation"] = coco_polygons(annotation["segmentation"])[0]
    line = renumbering_line(ann_file, annotations)
    if line is None:
        return data
    for k, annotation in enumerate(annotations, 1):
        annotation["id"] = k
    if str(ann_file) not in _RENUMBERED:
        _RENUMBERED.add(str(ann_file))
        if line not in {said for _, said in said_before()}:
            log.info(line)
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
    # the summary's lines (and faster-coco-eval's INFO log of each stage) are the caller's to say
    with contextlib.redirect_stdout(io.StringIO()), held_at(logging.WARNING, ["faster_coco_eval"]):
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
