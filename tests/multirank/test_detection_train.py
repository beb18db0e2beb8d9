"""Detection end to end: train.py on the built-in COCO-format set writes metrics with the 12 COCO
stats and weights; eval.py on that run reproduces the final evaluation exactly."""

import json
import re

from helpers import REPO, assert_png, run_cli
from omegaconf import OmegaConf

from visiondist.observe.metrics import read_metrics

DETECT = [
    "model=fasterrcnn_mobilenet_v3",
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
    "+model.kwargs.box_score_thresh=0.0",
    "model.roi_sampling_ratio=null",
]


def test_train_then_eval_a_detector(tmp_path):
    data = tmp_path / "shapes_coco"
    run = tmp_path / "run"
    result = run_cli([*DETECT, f"data.root={data}", f"trainer.run_dir={run}"], timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]" in result.stdout
    rows = read_metrics(run / "metrics.csv")
    final = [r for r in rows if r.get("val_mAP") is not None][-1]
    assert {"val_AP50", "val_ARl", "val_detections"} <= final.keys() and final["val_detections"] > 0
    assert len(json.loads((run / "detections.json").read_text())) == final["val_detections"]
    assert (run / "model.safetensors").stat().st_size > 0
    per_class = json.loads((run / "per_class.json").read_text())
    assert len(per_class) == 6 and all(v is None or 0 <= v <= 1 for v in per_class.values())
    for png in ("curves.png", "per_class_ap.png"):
        assert_png(run / png)
    assert_png(run / "val_predictions.png", min_width=800)

    evaluated = run_cli([f"run_dir={run}"], timeout=300, script=REPO / "tools" / "eval.py")
    assert evaluated.returncode == 0, evaluated.stdout[-4000:]
    assert evaluated.stdout.count("Average ") == 12
    out = next((run / "eval").iterdir())
    stats = json.loads((out / "eval.json").read_text())
    assert_png(out / "per_class_ap.png")  # tools/eval.py draws the evaluation too
    assert_png(out / "val_predictions.png", min_width=800)
    for key, value in final.items():
        if key.startswith("val_") and value is not None:  # val_ema_* stays empty without an EMA
            # the same weights, the same detections, the same numbers
            assert stats[key] == value, key

    _export_loads_in_torchvision(run, tmp_path)


def _export_loads_in_torchvision(run, tmp_path):
    """tools/export.py: torchvision's own builder loads the file strictly and detects exactly what
    the trained model does; the ONNX export matches under ONNX Runtime."""
    import onnxruntime as ort
    import torch
    import torchvision.models.detection as tvd
    from safetensors.torch import load_file

    from visiondist.checkpoint.export.trained import load_trained

    out = tmp_path / "detector.safetensors"
    exported = run_cli(
        [f"run_dir={run}", f"out={out}"], timeout=300, script=REPO / "tools" / "export.py"
    )
    assert exported.returncode == 0, exported.stdout[-4000:]
    info = json.loads(out.with_suffix(".json").read_text())
    assert info["library"] == "torchvision" and info["classes"][0] == "circle"
    # the checkpoint records the COCO category id of each label, and the export maps labels to them
    state = json.loads(next((run / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["category_ids"] == [1, 2, 3, 4, 5, 6] and info["labels"]["1"] == {
        "category_id": 1,
        "name": "circle",
    }
    builder = getattr(tvd, info["builder"].rsplit(".", 1)[1])
    model = builder(**info["kwargs"]).eval()
    model.load_state_dict(load_file(out), strict=True)
    # torchvision's own RoIAlign sampling here (DETECT), so the builder is exact
    assert "not_in_kwargs" not in info
    trained = load_trained(run)
    images = [torch.rand(3, 64, 48, generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        mine, theirs = trained.model(images)[0], model(images)[0]
    assert len(mine["boxes"]) > 0
    for key in ("boxes", "labels", "scores"):
        assert torch.equal(mine[key], theirs[key]), key

    onnx = tmp_path / "detector.onnx"
    exported = run_cli(
        [f"run_dir={run}", "format=onnx", f"out={onnx}"],
        timeout=300,
        script=REPO / "tools" / "export.py",
    )
    assert exported.returncode == 0, exported.stdout[-4000:]
    # the check ran on the run's val images, where the model returns boxes (DETECT: score threshold
    # 0)
    check = re.search(
        r"ONNX Runtime vs PyTorch: (\d+) boxes compared, max abs difference \S+ \(on 4 val images",
        exported.stdout,
    )
    assert check and int(check[1]) > 0, exported.stdout[-2000:]
    session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    # A model trained for 2 steps scores its boxes nearly alike (about 1/7 each), so top-k and NMS
    # ties can keep other boxes than PyTorch does: only the contract of the outputs is checked here,
    # on a batch of two sizes (the image axes and the batch are dynamic). Classifier ONNX outputs
    # are compared exactly in test_checkpoint.py.
    from visiondist.checkpoint.export.onnx_batch import canvas

    generator = torch.Generator().manual_seed(2)
    shapes = ((3, 64, 64), (3, 64, 48))
    feed, sizes = canvas([torch.rand(*shape, generator=generator) for shape in shapes])
    outputs = session.run(None, {"images": feed.numpy(), "sizes": sizes.numpy()})
    for i, shape in enumerate(shapes):
        n = int(outputs[3][i])
        boxes, labels, scores = (torch.from_numpy(a[i]) for a in outputs[:3])
        assert boxes.shape == (100, 4) and labels.shape == scores.shape == (100,) and n > 0
        assert not boxes[n:].any() and not labels[n:].any() and not scores[n:].any()
        boxes, labels, scores = boxes[:n], labels[:n], scores[:n]
        assert (
            (boxes[:, 0] >= 0).all()
            and (boxes[:, 2] <= shape[2]).all()
            and (boxes[:, 3] <= shape[1]).all()
        )
        assert (boxes[:, 2] >= boxes[:, 0]).all() and (boxes[:, 3] >= boxes[:, 1]).all()
        assert ((labels >= 1) & (labels <= 6)).all() and ((scores >= 0) & (scores <= 1)).all()

    # A threshold that no box passes: the file's graph is checked again with its thresholds at 0,
    # and says so
    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.onnx_check import check_onnx

    trained.model.roi_heads.score_thresh = 1.0
    strict = tmp_path / "strict.onnx"
    export(trained, "onnx", strict)
    result = check_onnx(trained, strict)
    assert result.lowered_from == {"rpn": 0.05, "box": 1.0} and result.boxes > 0, result.summary()
    assert result.onnx_boxes == result.boxes and "no box passed" in result.summary()
    assert trained.model.roi_heads.score_thresh == 1.0  # the model's own thresholds are back
    session = ort.InferenceSession(str(strict), providers=["CPUExecutionProvider"])
    # the file keeps 1.0
    feed, sizes = canvas(images)
    assert not session.run(None, {"images": feed.numpy(), "sizes": sizes.numpy()})[3].any()

    # the file predicts with the detector named and no data= (it reads none; the classes are the
    # file's)
    model = OmegaConf.load(run / "config.yaml").model.name
    val = next((run.parent / "shapes_coco" / "val").glob("*.jpg"))
    predicted = run_cli(
        [f"weights={onnx}", f"model={model}", f"source={val}", f"out={tmp_path / 'pred'}"],
        timeout=300,
        script=REPO / "tools" / "predict.py",
    )
    assert predicted.returncode == 0, predicted.stdout[-2000:]
    assert (tmp_path / "pred" / "detections.jsonl").is_file()


def test_eval_refuses_a_missing_run(tmp_path):
    result = run_cli([f"run_dir={tmp_path}"], timeout=60, script=REPO / "tools" / "eval.py")
    assert result.returncode == 2 and "holds no config.yaml" in result.stdout
