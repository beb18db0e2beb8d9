"""Detection end to end: train.py on the built-in COCO-format set writes metrics with the 12 COCO stats and weights;
eval.py on that run reproduces the final evaluation exactly."""

import json

from visiondist.engine.logging import read_metrics
from helpers import REPO, run_cli

DETECT = ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco", "data.synthetic.train_images=16",
          "data.synthetic.val_images=10", "data.synthetic.image_size=64", "data.min_size=64", "data.max_size=64",
          "data.batch_size=4", "data.eval_batch_size=4", "data.num_workers=0", "trainer.max_steps=2",
          "trainer.log_every=1", "trainer.accelerator=cpu", "trainer.progress=false", "trainer.tensorboard=false",
          "+model.kwargs.box_score_thresh=0.0"]


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

    evaluated = run_cli([str(run)], timeout=300, script=REPO / "tools" / "eval.py")
    assert evaluated.returncode == 0, evaluated.stdout[-4000:]
    assert evaluated.stdout.count("Average ") == 12
    out = next((run / "eval").iterdir())
    stats = json.loads((out / "eval.json").read_text())
    for key, value in final.items():
        if key.startswith("val_"):
            assert stats[key] == value, key  # the same weights, the same detections, the same numbers


def test_eval_refuses_a_missing_run(tmp_path):
    result = run_cli([str(tmp_path)], timeout=60, script=REPO / "tools" / "eval.py")
    assert result.returncode == 2 and "holds no config.yaml" in result.stdout
