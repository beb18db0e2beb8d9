"""A user's detection data trains from `data.root` alone (data=detection): one set written as COCO,
YOLO and VOC trains to the same losses step for step and scores the same mAP; a YOLO set, a VOC set
and a Roboflow export each train on 2 ranks and evaluate exactly as on 1."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import losses_of, run_cli

from visiondist.observe.metrics import read_metrics

DETECT = [
    "model=fasterrcnn_mobilenet_v3",
    "data=detection",
    "data.min_size=64",
    "data.max_size=64",
    "data.batch_size=4",
    "data.eval_batch_size=4",
    "data.num_workers=0",  # per-sample seeded augmentation: workers change no compared number
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "trainer.accelerator=cpu",
    "trainer.progress=false",
    "trainer.loggers=[csv]",
    "+model.kwargs.box_score_thresh=0.0",
    "model.roi_sampling_ratio=null",
]


@pytest.fixture(scope="module")
def forms(tmp_path_factory) -> dict[str, Path]:
    """The built-in shapes_coco set (16 train, 10 val images of 64 px), its boxes inside their
    images, written as YOLO; its YOLO index written as COCO, as VOC and as a Roboflow export."""
    from omegaconf import OmegaConf

    from visiondist.data.formats import resolve_detection
    from visiondist.data.formats.convert import write_coco, write_voc, write_yolo
    from visiondist.synthetic.shapes_coco import ensure_shapes_coco

    base = tmp_path_factory.mktemp("own")
    spec = SimpleNamespace(train_images=16, val_images=10, image_size=64, seed=0)
    source = ensure_shapes_coco(base / "shapes_coco", spec)
    splits = {}
    for split in ("train", "val"):
        coco = json.loads((source / "annotations" / f"instances_{split}.json").read_text())
        for ann in coco["annotations"]:
            ann.pop("segmentation", None)  # boxes only: a box model trains on them
        splits[split] = (coco, source / split)
    write_yolo(splits, base / "yolo")
    d = OmegaConf.create({"format": "auto", "root": str(base / "yolo"), "train_split": "train",
                          "val_split": "val", "num_classes": "???", "images": "", "annotations": "",
                          "found": None})  # fmt: skip
    resolve_detection(d, "train")
    index = {s: (json.loads(Path(d.annotations.format(split=s)).read_text()), Path(d.images))
             for s in ("train", "val")}  # fmt: skip
    write_coco(index, base / "coco")
    write_voc(index, base / "voc")
    roboflow = base / "roboflow"
    for split, folder in (("train", "train"), ("val", "valid")):
        write_coco({folder: index[split]}, roboflow)
        # as written: the images' names within the split's folder
        coco = json.loads((roboflow / "annotations" / f"instances_{folder}.json").read_text())
        (roboflow / folder / "_annotations.coco.json").write_text(
            json.dumps({**coco, "categories": [{"id": 0, "name": "shapes", "supercategory": "none"}]
                        + [{**c, "supercategory": "shapes"} for c in coco["categories"]]})
        )  # fmt: skip
    (roboflow / "annotations").rename(base / "roboflow_coco_files")  # Roboflow's layout alone
    return {"yolo": base / "yolo", "coco": base / "coco", "voc": base / "voc", "roboflow": roboflow}


def _train(root: Path, run: Path, *extra: str) -> str:
    result = run_cli([*DETECT, f"data.root={root}", f"trainer.run_dir={run}", *extra], timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def _final_eval(run: Path) -> dict:
    return [r for r in read_metrics(run / "metrics.csv") if r.get("val_mAP") is not None][-1]


def test_one_set_as_coco_yolo_voc_and_a_roboflow_export_trains_alike(forms, tmp_path):
    """The same boxes, images and image order in four forms: the same loss at every step, the same
    12 COCO numbers, the same class names in the weights."""
    said = {
        name: _train(forms[name], tmp_path / name) for name in ("coco", "yolo", "voc", "roboflow")
    }
    assert "is a YOLO set (data.yaml), 6 classes; train 16 images" in said["yolo"]
    assert "is a Pascal VOC set, 6 classes" in said["voc"]
    assert "is COCO in COCO's layout, 6 classes; train 16 images" in said["coco"]
    assert "is COCO in Roboflow's layout, 6 classes; train 16 images" in said["roboflow"]
    losses = {name: losses_of(tmp_path / name) for name in said}
    assert len(losses["coco"]) == 3
    assert losses["coco"] == losses["yolo"] == losses["voc"] == losses["roboflow"]
    evals = {name: _final_eval(tmp_path / name) for name in said}
    assert evals["coco"]["val_detections"] > 0
    assert evals["coco"] == evals["yolo"] == evals["voc"] == evals["roboflow"]
    classes = {name: json.loads((tmp_path / name / "per_class.json").read_text()) for name in said}
    assert list(classes["yolo"]) == ["circle", "square", "triangle", "star", "cross", "ring"]
    assert classes["coco"] == classes["yolo"] == classes["voc"] == classes["roboflow"]


@pytest.mark.parametrize("form", ["yolo", "voc", "roboflow"])
def test_a_users_set_trains_on_two_ranks_and_evaluates_as_on_one(forms, tmp_path, form):
    """2 DP ranks read the index the launching process built, each its shard of every batch; the
    evaluation of the trained weights on 2 ranks is the one eval.py makes on 1."""
    run = tmp_path / "run"
    root = forms[form] / "data.yaml" if form == "yolo" else forms[form]  # a YOLO set: its yaml
    said = _train(root, run, "trainer.devices=2", "parallel.dp=2")
    if form == "yolo":  # the predict line's example: the val images alone, not train's too
        assert f"source={forms['yolo'] / 'images' / 'val'} " in said, said[-2000:]
    # what the console said of the set before the run dir existed, once, heads train.log too
    found = {"yolo": "is a YOLO set (data.yaml)", "voc": "is a Pascal VOC set", "roboflow":
             "is COCO in Roboflow's layout"}[form]  # fmt: skip
    log = (run / "train.log").read_text()
    assert said.count(found) == 1 and log.count(found) == 1, log[:2000]
    assert log.index(found) < log.index("model fasterrcnn_mobilenet_v3")
    final = _final_eval(run)
    assert final["val_detections"] > 0 and len(losses_of(run)) == 3
    from helpers import REPO

    one = run_cli([f"run_dir={run}", "trainer.devices=1", "parallel.dp=1"], timeout=300,
                  script=REPO / "tools" / "eval.py")  # fmt: skip
    assert one.returncode == 0, one.stdout[-4000:]
    stats = json.loads(next((run / "eval").iterdir()).joinpath("eval.json").read_text())
    assert found in next((run / "eval").iterdir()).joinpath("eval.log").read_text()
    for key, value in final.items():
        if key.startswith("val_") and value is not None and not key.startswith("val_ema"):
            assert stats[key] == value, key
    if form == "yolo":  # and back out in its own form: a labels/ file an image
        _predicted_as_yolo(run, forms["yolo"])


def _predicted_as_yolo(run: Path, root: Path) -> None:
    """tools/predict.py save_txt=true on the val images: one labels/<stem>.txt an image, each line
    a detection of detections.jsonl as YOLO reads it (class from 0, box over the image's size)."""
    from helpers import REPO

    out = run / "yolo_predictions"
    said = run_cli([f"run_dir={run}", f"source={root / 'images' / 'val'}", f"out={out}",
                    "save_txt=true", "score_thresh=0", "save_images=0", "trainer.devices=1"],
                   timeout=300, script=REPO / "tools" / "predict.py")  # fmt: skip
    assert said.returncode == 0, said.stdout[-4000:]
    records = [json.loads(line) for line in (out / "detections.jsonl").read_text().splitlines()]
    assert len(records) == 10 and sorted(p.stem for p in (out / "labels").iterdir()) == sorted(
        Path(r["file"]).stem for r in records
    )
    found = 0
    for r in records:
        lines = (out / "labels" / f"{Path(r['file']).stem}.txt").read_text().splitlines()
        assert len(lines) == len(r["detections"])
        for line, d in zip(lines, r["detections"]):
            label, cx, cy, w, h, score = line.split()
            x0, y0, x1, y1 = d["box"]
            assert int(label) == d["label"] - 1 and abs(float(score) - d["score"]) < 1e-5
            assert abs(float(cx) * r["width"] - (x0 + x1) / 2) < 1e-3
            assert abs(float(w) * r["width"] - (x1 - x0)) < 1e-3
            assert abs(float(cy) * r["height"] - (y0 + y1) / 2) < 1e-3
            assert abs(float(h) * r["height"] - (y1 - y0)) < 1e-3
            found += 1
    assert found > 0


def test_convert_writes_a_built_in_set_as_yolo_counting_what_yolo_cannot_hold(tmp_path):
    """tools/data.py convert on the built-in shapes_coco (its crowd regions included): the objects
    it says it wrote are the label lines on disk, the crowd regions it left out are the file's, and
    the YOLO set it wrote trains."""
    from helpers import REPO

    out = tmp_path / "yolo"
    said = run_cli(["convert", "data=shapes_coco", f"data.root={tmp_path / 'shapes'}",
                    "data.synthetic.train_images=24", "data.synthetic.val_images=12", "to=yolo",
                    f"out={out}"], timeout=300, script=REPO / "tools" / "data.py")  # fmt: skip
    assert said.returncode == 0, said.stdout[-4000:]
    for split in ("train", "val"):
        coco = json.loads(
            (tmp_path / "shapes" / "annotations" / f"instances_{split}.json").read_text()
        )
        crowd = sum(1 for a in coco["annotations"] if a.get("iscrowd"))
        lines = sum(len(p.read_text().splitlines()) for p in (out / "labels" / split).iterdir())
        assert lines == len(coco["annotations"]) - crowd
        left = f" ({crowd} crowd regions left out (YOLO holds none))" if crowd else ""
        assert (
            f"{split}: {len(coco['images'])} images, {lines} objects written{left}" in said.stdout
        )
    assert "crowd regions left out" in said.stdout  # the set has some
    trained = _train(out, tmp_path / "run", "trainer.max_steps=1")
    assert "is a YOLO set (data.yaml), 6 classes; train 24 images" in trained


def test_the_index_pool_ends_quietly_under_a_tools_stop_handling():
    """The tools handle stop signals at once (a `StopNow` in the main thread); the index's forked
    pool inherits that, and the pool ends its workers with SIGTERM as it closes: each printed a
    StopNow traceback before a training run's first line. Run as a tool runs it, in a process of
    its own."""
    import subprocess
    import sys

    code = (
        "from visiondist.utils.signals import StopSignals\n"
        "from visiondist.data.formats.labels import _map\n"
        "StopSignals().install(at_once=True)\n"
        "print(sum(_map(abs, list(range(-50, 50)), 2)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "2500", done.stderr
    assert "Traceback" not in done.stderr and "StopNow" not in done.stderr, done.stderr


def _mixed_sizes(source: Path, out: Path) -> Path:
    """The COCO form with two of every three val images resized (96 x 64 and 64 x 80 px, their
    boxes scaled): three padded shapes for a detector at min_size 64, max_size 96."""
    import shutil

    from PIL import Image

    shutil.copytree(source, out)
    ann = out / "annotations" / "instances_val.json"
    coco = json.loads(ann.read_text())
    scale = {}
    for i, image in enumerate(coco["images"]):
        size = [None, (96, 64), (64, 80)][i % 3]
        if size is None:
            continue
        path = out / "val" / image["file_name"]
        with Image.open(path) as im:
            sx, sy = size[0] / im.width, size[1] / im.height
            im.convert("RGB").resize(size).save(path, quality=95)
        image["width"], image["height"] = size
        scale[image["id"]] = (sx, sy)
    for a in coco["annotations"]:
        sx, sy = scale.get(a["image_id"], (1.0, 1.0))
        x, y, w, h = a["bbox"]
        a["bbox"] = [x * sx, y * sy, w * sx, h * sy]
        a["area"] = w * sx * h * sy
    ann.write_text(json.dumps(coco))
    return out


def test_a_detectors_evaluation_of_mixed_sizes_does_not_depend_on_batch_or_ranks(forms, tmp_path):
    """A torchvision R-CNN pads a batch to its largest image, which changes what its convolutions
    see near the edges: batches of one padded shape give every image what it gets alone, so one
    rank scoring an image at a time and two ranks in batches of 8 give the same 12 COCO numbers
    and the same detections, and so does a prediction of the folder in batches of 8 (a forward
    for each padded shape in a batch). model.max_size=96 keeps the three sizes apart after the
    resize."""
    from helpers import REPO

    run = tmp_path / "run"
    _train(forms["coco"], run)
    mixed = _mixed_sizes(forms["coco"], tmp_path / "mixed")
    stats, found = [], []
    for extra in (["data.eval_batch_size=1", "trainer.devices=1", "parallel.dp=1"],
                  ["data.eval_batch_size=8", "trainer.devices=2", "parallel.dp=2"]):  # fmt: skip
        out = tmp_path / f"eval{len(stats)}"
        said = run_cli([f"run_dir={run}", f"data.root={mixed}", "model.max_size=96",
                        f"trainer.run_dir={out}", *extra],
                       timeout=300, script=REPO / "tools" / "eval.py")  # fmt: skip
        assert said.returncode == 0, said.stdout[-4000:]
        stats.append(json.loads(next(out.rglob("eval.json")).read_text()))
        detections = json.loads(next(out.rglob("detections.json")).read_text())
        found.append({(d["image_id"], d["category_id"], round(d["score"], 4),
                       *(round(v, 1) for v in d["bbox"])) for d in detections})  # fmt: skip
    assert stats[0]["val_detections"] > 0
    # the same detections but where float32's rounding in a batch of another size moved a
    # near-tie (1 of 970 here; batches mixing padded shapes: 753 of 970, and 30 more found)
    assert len(found[0]) == len(found[1]) and len(found[0] - found[1]) <= len(found[0]) // 100
    numbers = [
        {k: v for k, v in s.items() if k.startswith("val_") and isinstance(v, (int, float))}
        for s in stats
    ]
    assert numbers[0] == pytest.approx(numbers[1], abs=2e-3)

    out = tmp_path / "predicted"
    said = run_cli([f"run_dir={run}", f"source={mixed / 'val'}", f"data.root={mixed}", f"out={out}",
                    "model.max_size=96",
                    "score_thresh=0", "batch=8", "save_images=0", "trainer.progress=false"],
                   timeout=300, script=REPO / "tools" / "predict.py")  # fmt: skip
    assert said.returncode == 0, said.stdout[-4000:]
    predicted = {(d["image_id"], d["category_id"], round(d["score"], 4),
                  *(round(v, 1) for v in d["bbox"]))
                 for d in json.loads((out / "results.json").read_text())}  # fmt: skip
    # (a forward for the whole batch of 8: 757 of 970 differ, and 1000 found)
    assert len(predicted) == len(found[0])
    assert len(found[0] - predicted) <= len(found[0]) // 100
