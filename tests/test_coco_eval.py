"""Distributed COCO evaluation is exact: 2 and 3 ranks give the 12 stats of one process, of pycocotools on the written
detections.json, and faster-coco-eval equals pycocotools."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

import coco_ranks
from visiondist.engine.coco_eval import STAT_NAMES, deduplicate, predict, score, summary_lines
from helpers import spawn_ranks


@pytest.fixture(scope="module")
def shapes_coco(tmp_path_factory):
    from visiondist.data.builtin import ensure_shapes_coco

    spec = SimpleNamespace(train_images=8, val_images=23, image_size=64, seed=0)  # 23: no even split over 2 or 3
    return ensure_shapes_coco(tmp_path_factory.mktemp("data") / "shapes_coco", spec)


@pytest.fixture(scope="module")
def single_process(shapes_coco):
    data = coco_ranks.val_set(shapes_coco)
    detections, seen = predict(coco_ranks.StandInDetector(data), coco_ranks.loader(data, 0, 1), "cpu", data.cat_of)
    dets, count = deduplicate([(detections, seen)], expected=len(data))
    assert count == 23 and len(dets) > 23
    return dets, score(data.ann_file, dets, backend="pycocotools"), data


def test_stats_are_meaningful_and_backends_agree(single_process):
    dets, stats, data = single_process
    assert 0.2 < stats["mAP"] < 0.9 and stats["AP50"] > stats["mAP"]  # neither trivial nor perfect
    assert score(data.ann_file, dets, backend="faster-coco-eval") == stats
    assert len(summary_lines(stats).splitlines()) == 12


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.smoke), 3])
def test_distributed_eval_equals_one_process_and_pycocotools(tmp_path, shapes_coco, single_process, world):
    dets, single, data = single_process
    results = spawn_ranks(coco_ranks.run, world, str(shapes_coco), str(tmp_path))
    assert sorted(r["shard"] for r in results.values()) == sorted([23 // world + (i < 23 % world) for i in range(world)])
    for result in results.values():  # every rank gets rank 0's answer
        stats = result["stats"]
        assert {k: stats[f"val_{k}"] for k in STAT_NAMES} == single
        assert stats["val_count"] == 23 and stats["val_detections"] == len(dets)

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    written = json.loads((tmp_path / "detections.json").read_text())
    assert len(written) == len(dets) and {"image_id", "category_id", "bbox", "score"} <= written[0].keys()
    gt = COCO(str(data.ann_file))
    evaluator = COCOeval(gt, gt.loadRes(str(tmp_path / "detections.json")), iouType="bbox")
    evaluator.evaluate()
    evaluator.accumulate()
    evaluator.summarize()
    assert dict(zip(STAT_NAMES, map(float, evaluator.stats))) == single


def test_missing_or_duplicated_images_are_caught():
    a = (np.array([[1, 0, 0, 5, 5, 0.9, 1]]), [1, 2])
    b = (np.array([[2, 0, 0, 5, 5, 0.8, 1], [3, 0, 0, 5, 5, 0.7, 1]]), [2, 3])  # image 2 reported twice
    dets, count = deduplicate([a, b], expected=3)
    assert count == 3 and sorted(dets[:, 0].tolist()) == [1, 3]  # image 2's rows from the first report (none)
    with pytest.raises(RuntimeError, match="saw 2 distinct images, expected 3"):
        deduplicate([a], expected=3)


def test_a_scoring_failure_on_rank_0_reaches_every_rank(tmp_path, shapes_coco):
    """Rank 0 finds the image count wrong while the others wait for its answer: all of them fail, none hangs."""
    results = spawn_ranks(coco_ranks.run, 2, str(shapes_coco), str(tmp_path), 24)
    assert [r["error"] for r in results.values()] == ["COCO evaluation saw 23 distinct images, expected 24"] * 2


@pytest.mark.parametrize("backend", ["pycocotools", "faster-coco-eval"])
def test_per_class_ap_averages_to_the_map(single_process, backend):
    """Per-category AP (the per-class bar chart) is COCOeval's own precision array split by category: its mean over
    the categories is the overall AP, and the per-class values differ (the stand-in detector is better at some)."""
    dets, stats, data = single_process
    scored = score(data.ann_file, dets, backend=backend, per_class=True)
    per_class = scored.pop("class_AP")
    assert scored == stats
    names = [c["name"] for c in json.loads(data.ann_file.read_text())["categories"]]
    assert list(per_class) == names
    values = [v for v in per_class.values() if v is not None]
    assert len(values) >= 2 and len(set(values)) > 1
    assert np.mean(values) == pytest.approx(stats["mAP"], abs=1e-12)
