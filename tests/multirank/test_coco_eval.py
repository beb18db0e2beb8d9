"""Distributed COCO evaluation is exact: 2 and 3 ranks give the 12 stats of one process, of
pycocotools on the written detections.json, and faster-coco-eval equals pycocotools."""

import json

import coco_ranks
import pytest
from helpers import spawn_ranks

from visiondist.evaluation.coco_scoring import STAT_NAMES


@pytest.mark.parametrize(
    "world", [pytest.param(2, marks=[pytest.mark.smoke, pytest.mark.layouts]), 3]
)
def test_distributed_eval_equals_one_process_and_pycocotools(
    tmp_path, shapes_coco, single_process, world
):
    dets, single, data = single_process
    results = spawn_ranks(coco_ranks.run, world, str(shapes_coco), str(tmp_path))
    assert sorted(r["shard"] for r in results.values()) == sorted(
        [23 // world + (i < 23 % world) for i in range(world)]
    )
    for result in results.values():  # every rank gets rank 0's answer
        stats = result["stats"]
        assert {k: stats[f"val_{k}"] for k in STAT_NAMES} == single
        assert stats["val_count"] == 23 and stats["val_detections"] == len(dets)

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    written = json.loads((tmp_path / "detections.json").read_text())
    assert (
        len(written) == len(dets)
        and {"image_id", "category_id", "bbox", "score"} <= written[0].keys()
    )
    gt = COCO(str(data.ann_file))
    evaluator = COCOeval(gt, gt.loadRes(str(tmp_path / "detections.json")), iouType="bbox")
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    assert dict(zip(STAT_NAMES, map(float, evaluator.stats))) == single


def test_a_scoring_failure_on_rank_0_reaches_every_rank(tmp_path, shapes_coco):
    """Rank 0 finds the image count wrong while the others wait for its answer: all of them fail,
    none hangs."""
    results = spawn_ranks(coco_ranks.run, 2, str(shapes_coco), str(tmp_path), 24)
    assert [r["error"] for r in results.values()] == [
        "COCO evaluation saw 23 distinct images, expected 24"
    ] * 2


def test_mask_eval_on_2_and_3_ranks_equals_1_rank_and_pycocotools_on_the_written_masks(
    tmp_path, shapes_coco
):
    """A stand-in mask model (ground-truth masks shifted, rims near the threshold, filled false
    positives): the 12 segm stats and the 12 bbox stats of 2 and 3 ranks are those of 1 rank, and
    plain pycocotools scoring the written segmentations.json / detections.json gives the printed
    numbers."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    runs = {}
    for world in (1, 2, 3):
        out = tmp_path / f"dp{world}"
        out.mkdir()
        runs[world] = (
            out,
            spawn_ranks(coco_ranks.run, world, str(shapes_coco), str(out), 0, True)[0]["stats"],
        )
    one = runs[1][1]
    segm = {k: one[f"val_segm_{k}"] for k in STAT_NAMES}
    # a real score, not a trivial one
    assert 0.05 < segm["mAP"] < 0.95 and segm["mAP"] != one["val_mAP"]
    for world in (2, 3):
        assert {
            k: v for k, v in runs[world][1].items() if k.startswith("val_") and "class" not in k
        } == {k: v for k, v in one.items() if k.startswith("val_") and "class" not in k}
    gt = COCO(str(shapes_coco / "annotations" / "instances_val.json"))
    # crowd regions are scored as COCO does
    assert sum(a["iscrowd"] for a in gt.dataset["annotations"]) >= 1
    for out, stats in runs.values():
        for iou_type, name, prefix in (
            ("segm", "segmentations.json", "val_segm_"),
            ("bbox", "detections.json", "val_"),
        ):
            evaluator = COCOeval(gt, gt.loadRes(str(out / name)), iouType=iou_type)
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
            assert dict(zip(STAT_NAMES, map(float, evaluator.stats))) == {
                k: stats[prefix + k] for k in STAT_NAMES
            }
