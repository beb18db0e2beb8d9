"""Instance segmentation end to end: a Mask R-CNN trained by train.py on the built-in COCO-format
set reports the 12 box and the 12 mask stats, eval.py reproduces them, the export loads strictly
into torchvision's classes and detects the same boxes and masks, and its ONNX masks match PyTorch's
under ONNX Runtime; ViTDet with a mask head trains under tensor parallelism and exports to ONNX."""

import json
import re

import pytest
from helpers import REPO, assert_png, run_cli

from visiondist.observe.metrics import read_metrics

MASKS = [
    "model=maskrcnn_mobilenet_v3",
    "data=shapes_coco",
    "data.synthetic.train_images=16",
    "data.synthetic.val_images=10",
    "data.synthetic.image_size=64",
    "data.min_size=64",
    "data.max_size=64",
    "data.batch_size=4",
    "data.eval_batch_size=4",
    "data.num_workers=0",
    "trainer.max_steps=2",
    "trainer.log_every=1",
    "trainer.accelerator=cpu",
    "trainer.progress=false",
    "trainer.loggers=[csv]",
    # RoIAlign: 1 sample per bin, the tuned setting's (not torchvision's)
    "+model.kwargs.box_score_thresh=0.0",
]


def test_train_eval_and_export_a_mask_model(tmp_path):
    run = tmp_path / "run"
    result = run_cli(
        [*MASKS, f"data.root={tmp_path / 'data'}", f"trainer.run_dir={run}"], timeout=300
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert (
        "bbox:" in result.stdout
        and "segm:" in result.stdout
        and result.stdout.count("Average ") == 24
    )
    assert "mask mAP@[.5:.95]" in result.stdout
    final = [r for r in read_metrics(run / "metrics.csv") if r.get("val_segm_mAP") is not None][-1]
    assert {"val_mAP", "val_segm_AP50", "val_segm_ARl"} <= final.keys()
    assert len(json.loads((run / "segmentations.json").read_text())) == final["val_detections"] > 0
    assert_png(run / "val_masks.png", min_width=800)

    evaluated = run_cli([f"run_dir={run}"], timeout=300, script=REPO / "tools" / "eval.py")
    assert evaluated.returncode == 0, evaluated.stdout[-4000:]
    stats = json.loads((next((run / "eval").iterdir()) / "eval.json").read_text())
    for key, value in final.items():
        if key.startswith("val_") and value is not None:
            assert stats[key] == value, key  # the same weights, the same masks, the same numbers

    # tools/predict.py on the val folder, at the evaluation's batch, everything kept: the
    # evaluation's masks
    out = tmp_path / "predicted"
    predicted = run_cli(
        [
            f"run_dir={run}",
            f"source={tmp_path / 'data' / 'val'}",
            f"out={out}",
            "score_thresh=0",
            "batch=4",
            "save_images=2",
        ],
        timeout=300,
        script=REPO / "tools" / "predict.py",
    )
    assert predicted.returncode == 0, predicted.stdout[-4000:]
    ours = json.loads((out / "results.json").read_text())
    assert [
        {k: d[k] for k in ("image_id", "category_id", "segmentation", "score")} for d in ours
    ] == json.loads((run / "segmentations.json").read_text())
    assert all(
        "mask" in d
        for line in (out / "detections.jsonl").read_text().splitlines()
        for d in json.loads(line)["detections"]
    )
    assert len(list((out / "images").iterdir())) == 2
    _export_loads_in_torchvision(run, tmp_path)


def _export_loads_in_torchvision(run, tmp_path):
    import torch

    from visiondist.checkpoint.export.trained import load_trained

    out = tmp_path / "masks.safetensors"
    exported = run_cli(
        [f"run_dir={run}", f"out={out}"], timeout=300, script=REPO / "tools" / "export.py"
    )
    assert exported.returncode == 0, exported.stdout[-4000:]
    info = json.loads(out.with_suffix(".json").read_text())
    assert (
        info["builder"] == "torchvision.models.detection.MaskRCNN"
        and "_mobilenet_extractor" in info["usage"]
    )
    assert info["labels"]["1"] == {"category_id": 1, "name": "circle"}
    # the sidecar's usage, run as written: torchvision's classes only
    code = info["usage"].split("  (kwargs:")[0]
    assert "sampling_ratio = 1" in code and "visiondist" not in code
    scope = {"kwargs": info["kwargs"], "path": str(out)}
    exec(code, scope)
    model = scope["model"].eval()
    trained = load_trained(run)
    images = [torch.rand(3, 64, 48, generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        mine, theirs = trained.model(images)[0], model(images)[0]
    assert len(mine["masks"]) > 0
    for key in ("boxes", "labels", "scores", "masks"):
        assert torch.equal(mine[key], theirs[key]), key

    # a model trained for 2 steps scores its boxes nearly alike, so top-k and NMS ties keep some
    # other boxes in ONNX Runtime (the box check says so); the masks of the boxes both keep are
    # compared
    _onnx_masks_match(run, tmp_path / "masks.onnx")


def _onnx_masks_match(run, onnx) -> str:
    """Export `run` to `onnx` with tools/export.py; its check compared masks and they match. Returns
    the check line."""
    exported = run_cli(
        [f"run_dir={run}", "format=onnx", f"out={onnx}"],
        timeout=300,
        script=REPO / "tools" / "export.py",
    )
    assert exported.returncode == 0, exported.stdout[-4000:]
    check = re.search(
        r"(\d+) boxes compared, .*; (\d+) masks \(of the same boxes\) compared, max abs difference "
        r"([0-9.e+-]+)",
        exported.stdout,
    )
    assert check and int(check[2]) > 0 and float(check[3]) < 1e-3, exported.stdout[-2000:]
    return check[0]


@pytest.mark.slow
def test_vitdet_with_a_mask_head_trains_under_tensor_parallelism_and_exports_to_onnx(tmp_path):
    run = tmp_path / "run"
    args = [
        *MASKS,
        "model=vitdet_tiny",
        "model.masks=true",
        "model.depth=2",
        "model.fpn_channels=32",
        "parallel.tp=2",
        f"data.root={tmp_path / 'data'}",
        f"trainer.run_dir={run}",
    ]
    result = run_cli(args, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "tp=2" in result.stdout and "segm:" in result.stdout
    final = [r for r in read_metrics(run / "metrics.csv") if r.get("val_segm_mAP") is not None][-1]
    assert final["val_detections"] > 0

    # the consolidated weights of the tp=2 run as one ONNX graph with masks, checked in ONNX Runtime
    # on val images
    check = _onnx_masks_match(run, tmp_path / "vitdet.onnx")
    assert "val images" in check, check


def test_a_messy_annotation_file_trains_a_mask_model_leaving_out_what_has_no_mask(tmp_path):
    """`data=coco` on the built-in set with one `segmentation: []` and one polygon of 2 points (a
    run stopped at a rank on the first and trained the second as an empty mask): both are said
    before any rank starts, left out, counted in the summary; the run trains and leaves no failure
    record."""
    import shutil

    from visiondist.cli import load_config
    from visiondist.synthetic import prepare_data

    built = tmp_path / "built"
    prepare_data(
        load_config(REPO / "configs", [*MASKS[:5], f"data.root={built}"], inputs=None).data
    )
    root = tmp_path / "messy"
    shutil.copytree(built, root)
    ann_file = root / "annotations" / "instances_train.json"
    coco = json.loads(ann_file.read_text())
    polygons = [
        a for a in coco["annotations"] if not a["iscrowd"] and isinstance(a["segmentation"], list)
    ]
    polygons[0]["segmentation"], polygons[1]["segmentation"] = [], [[2.0, 2.0, 9.0, 9.0]]
    ann_file.write_text(json.dumps(coco))
    run = tmp_path / "run"
    args = [
        "model=maskrcnn_mobilenet_v3",
        "data=coco",
        f"data.root={root}",
        "data.train_split=train",
        "data.val_split=val",
        *MASKS[5:],
        f"trainer.run_dir={run}",
    ]
    result = run_cli(args, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    ids = (
        f"annotation ids {polygons[0]['id']}, {polygons[1]['id']}: empty, or polygons of fewer "
        "than 3 points"
    )
    line = "instances_train.json: 2 instances without a valid segmentation are left out of training"
    assert line in result.stdout and ids in result.stdout
    # before the ranks
    assert result.stdout.index(line) < result.stdout.index("parallel=auto chose")
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["instances without a valid mask (left out)"] == 2 and not (run / "failure").exists()
    )
