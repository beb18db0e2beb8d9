"""COCO scoring in one process: the 12 stats are meaningful and faster-coco-eval equals pycocotools,
missing or duplicated images are caught, per-class AP averages to the mAP. Across ranks:
tests/multirank/test_coco_eval.py."""

import json

import numpy as np
import pytest

from visiondist.evaluation.coco_scoring import score, summary_lines
from visiondist.evaluation.detection import deduplicate


def test_stats_are_meaningful_and_backends_agree(single_process):
    dets, stats, data = single_process
    assert 0.2 < stats["mAP"] < 0.9 and stats["AP50"] > stats["mAP"]  # neither trivial nor perfect
    # the same detections, two implementations of COCOeval in double precision: equal to their last
    # bits
    assert score(data.ann_file, dets, backend="faster-coco-eval") == pytest.approx(stats, abs=1e-9)
    assert len(summary_lines(stats).splitlines()) == 12


def test_missing_or_duplicated_images_are_caught():
    a = (np.array([[1, 0, 0, 5, 5, 0.9, 1]]), [1, 2])
    # image 2 reported twice
    b = (np.array([[2, 0, 0, 5, 5, 0.8, 1], [3, 0, 0, 5, 5, 0.7, 1]]), [2, 3])
    dets, count, _ = deduplicate([a, b], expected=3)
    # image 2's rows from the first report (none)
    assert count == 3 and sorted(dets[:, 0].tolist()) == [1, 3]
    with pytest.raises(RuntimeError, match="saw 2 distinct images, expected 3"):
        deduplicate([a], expected=3)


@pytest.mark.parametrize("backend", ["pycocotools", "faster-coco-eval"])
def test_per_class_ap_averages_to_the_map(single_process, backend):
    """Per-category AP (the per-class bar chart) is COCOeval's own precision array split by
    category: its mean over the categories is the overall AP, and the per-class values differ (the
    stand-in detector is better at some)."""
    dets, stats, data = single_process
    scored = score(data.ann_file, dets, backend=backend, per_class=True)
    per_class = scored.pop("class_AP")
    assert scored == stats
    names = [c["name"] for c in json.loads(data.ann_file.read_text())["categories"]]
    assert list(per_class) == names
    values = [v for v in per_class.values() if v is not None]
    assert len(values) >= 2 and len(set(values)) > 1
    assert np.mean(values) == pytest.approx(stats["mAP"], abs=1e-12)


@pytest.mark.parametrize("backend", ["pycocotools", "faster-coco-eval"])
def test_annotation_ids_from_0_score_as_the_same_boxes_numbered_from_1(
    single_process, tmp_path, backend, caplog
):
    """Label Studio and other tools number annotations from 0; COCOeval reads a match with id 0 as
    none. The same boxes numbered from 0 (or all 7) score as numbered from 1, and the log says
    so."""
    dets, stats, data = single_process
    coco = json.loads(data.ann_file.read_text())
    for ids in ("from 0", "all 7"):
        for k, annotation in enumerate(coco["annotations"]):
            annotation["id"] = k if ids == "from 0" else 7
        path = tmp_path / f"{backend}_{ids.replace(' ', '_')}.json"  # said once a file
        path.write_text(json.dumps(coco))
        with caplog.at_level("INFO"):
            assert score(path, dets, backend=backend) == pytest.approx(stats, abs=1e-12)
        assert f"{path}: its {len(coco['annotations'])} annotation ids scored as 1-" in caplog.text
