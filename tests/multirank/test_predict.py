"""tools/predict.py as a user runs it, on a tiny ViT classifier and a tiny Faster R-CNN trained
here: predictions on the run's val images equal its evaluation's; 1, 2 and 3 ranks write identical
files; a killed prediction continues to the files an uninterrupted one writes; unreadable files are
named and skipped; bad input is refused before any rank starts; the Python entry gives what the
files hold; a video gets its annotated copy."""

import csv
import json
import sys
from pathlib import Path

import pytest
from helpers import REPO, TINY_DATA, finish_job, job_env, run_cli, start_job, train_ok

pytestmark = pytest.mark.xdist_group("predict")  # one worker: the classifier run is trained once
PREDICT = REPO / "tools" / "predict.py"
FAULT = REPO / "tests" / "multirank" / "fault_train.py"
DETECT = [
    "model=fasterrcnn_mobilenet_v3",
    "data=shapes_coco",
    "data.synthetic.train_images=8",
    "data.synthetic.val_images=9",
    "data.synthetic.image_size=64",
    "data.min_size=64",
    "data.max_size=64",
    "data.batch_size=4",
    "data.eval_batch_size=4",
    "data.num_workers=0",
    "trainer.max_steps=1",
    "trainer.accelerator=cpu",
    "trainer.progress=false",
    "trainer.loggers=[csv]",
    "trainer.plots=false",
    "+model.kwargs.box_score_thresh=0.0",
    "model.roi_sampling_ratio=null",
]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, tiny_shapes):
    """A 2-step tiny ViT run on the shapes set (its end-of-run evaluation in metrics.csv)."""
    run = tmp_path_factory.mktemp("cls") / "run"
    train_ok(
        *TINY_DATA,
        f"data.root={tiny_shapes}",
        "data.batch_size=16",
        "trainer.accelerator=cpu",
        "trainer.loggers=[csv]",
        "trainer.max_steps=2",
        f"trainer.run_dir={run}",
    )
    return run, tiny_shapes


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    """A 1-step Faster R-CNN run on a 9-image COCO-format val split (its evaluation's
    detections.json)."""
    root = tmp_path_factory.mktemp("det")
    run = root / "run"
    train_ok(*DETECT, f"data.root={root / 'data'}", f"trainer.run_dir={run}")
    return run, root / "data"


def predict_ok(*args: str, timeout: float = 240) -> str:
    result = run_cli(list(args), timeout=timeout, script=PREDICT)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def rows(out: Path) -> list[list[str]]:
    with open(out / "predictions.csv", newline="") as f:
        return list(csv.reader(f))


def assert_same_predictions(out: Path, reference: Path) -> None:
    """The same predictions.csv: byte for byte, but for at most one row whose order of a near-tie a
    last-bit difference flipped (a 2-step model's near-uniform probabilities; seen once in five
    clean-clone runs, a label_2 on torch 2.11): the same file and probabilities to 1e-5, a label
    differing only where its probability ties another shown one or it is the last shown (its
    rival not shown)."""
    ours, theirs = rows(out), rows(reference)
    assert len(ours) == len(theirs) and ours[0] == theirs[0]
    differ = [(a, b) for a, b in zip(ours, theirs) if a != b]
    assert len(differ) <= 1, differ
    for a, b in differ:
        probs_a, probs_b = [float(v) for v in a[2::2]], [float(v) for v in b[2::2]]
        assert a[0] == b[0] and probs_a == pytest.approx(probs_b, abs=1e-5), (a, b)
        for k, (label_a, label_b) in enumerate(zip(a[1::2], b[1::2])):
            ties = [j for j, p in enumerate(probs_a) if j != k and abs(p - probs_a[k]) < 1e-5]
            assert label_a == label_b or ties or k == len(probs_a) - 1, (a, b)


@pytest.mark.smoke  # the GPU machines' torch 2.11 as well as the newest
def test_a_classifier_predicts_what_its_evaluation_scored_on_1_2_and_3_ranks(classifier, tmp_path):
    """The val folder predicted on 1, 2 and 3 ranks: the same predictions.csv (byte for byte but for
    a near-tie: `assert_same_predictions`), in the folder's order, whose top-1 labels score exactly
    the run's final val top-1; the first images drawn; the Python entry yields the same."""
    from visiondist.inference import predict
    from visiondist.observe.metrics import read_metrics

    run, data = classifier
    val = data / "val"
    outs = []
    for ranks in (1, 2, 3):
        out = tmp_path / f"r{ranks}"
        printed = predict_ok(
            f"run_dir={run}",
            f"source={val}",
            f"out={out}",
            f"trainer.devices={ranks}",
            "save_images=3",
            "topk=2",
            "batch=4",
            "trainer.progress=false",
        )
        assert (
            f"predict dir: {out} (predictions.csv, images/ (3 drawn), predict.json, predict.log)"
            in printed
        )
        # the names come from the run's weights: model.safetensors records them, as an export's file
        # does
        assert (
            f"with {run / 'model.safetensors'} (classes from {run / 'model.safetensors'};"
            in printed
        ), printed
        outs.append(out)
    from safetensors import safe_open

    with safe_open(str(run / "model.safetensors"), "pt") as weights:
        assert json.loads(weights.metadata()["classes"]) == sorted(
            p.name for p in val.iterdir() if p.is_dir()
        )
    table = rows(outs[0])
    for out in outs[1:]:
        assert_same_predictions(out, outs[0])
    assert table[0] == ["file", "label_1", "prob_1", "label_2", "prob_2"]
    files = sorted(str(p.relative_to(val)) for p in val.rglob("*.png")) or sorted(
        str(p.relative_to(val)) for p in val.rglob("*.jpg")
    )
    assert [r[0] for r in table[1:]] == files and len(files) == 30
    correct = sum(Path(r[0]).parts[0] == r[1] for r in table[1:])
    final = [r for r in read_metrics(run / "metrics.csv") if r.get("val_top1") is not None][-1]
    assert 100.0 * correct / len(files) == pytest.approx(final["val_top1"], abs=1e-9)
    assert all(float(r[2]) >= float(r[4]) for r in table[1:])
    drawn = sorted(p.name for p in (outs[0] / "images").iterdir())
    assert len(drawn) == 3 and drawn[0].startswith("000000_")
    manifest = json.loads((outs[0] / "predict.json").read_text())
    assert manifest["state"] == "complete" and manifest["counts"] == {"images": 30, "unreadable": 0}

    # the run exported (safetensors and its model.json), predicted from the file under other data
    # settings and no class count (data=imagenet leaves it to the data, which prediction does not
    # read): the export's record of the run's preprocessing and class names gives the run's
    # predictions
    exported = tmp_path / "vit.safetensors"
    run_cli([f"run_dir={run}", f"out={exported}"], timeout=240, script=REPO / "tools" / "export.py")
    out = tmp_path / "export"
    printed = predict_ok(
        f"weights={exported}",
        "model=vit_tiny",
        "model.depth=2",
        "data=imagenet",
        "data.img_size=32",
        f"source={val}",
        f"out={out}",
        "save_images=false",  # as 0: none drawn
        "topk=2",
        "batch=4",
        "trainer.progress=false",
    )
    assert "preprocessing as vit.json records the run's: data.mean=[0.5, 0.5, 0.5]" in printed
    assert_same_predictions(out, outs[0])
    assert not list(out.glob("images/*"))

    yielded = list(predict(str(val), run_dir=str(run), topk=2, batch_size=4, device="cpu"))
    assert [(r["file"], r["top"][0]["name"]) for r in yielded] == [(r[0], r[1]) for r in table[1:]]
    assert [f"{r['top'][1]['prob']:.6f}" for r in yielded] == [r[4] for r in table[1:]]


def test_a_killed_prediction_continues_to_the_same_files_and_then_says_it_is_complete(
    classifier, tmp_path
):
    """Real photographs (benchmarks/photos.py) on 2 ranks, the job SIGKILLed once rank 0 wrote its
    first batch; the same command again (the default run dir under <run>/predict/) continues it, and
    the files equal an uninterrupted run's; a third time says complete. An empty and a broken file
    in the folder are named with their reasons and skipped, never fatal."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from photos import build_photos

    run, _ = classifier
    source = tmp_path / "photos"
    build_photos(source, 20, split="val")
    (source / "val" / "coffee" / "empty.JPEG").write_bytes(b"")
    (source / "val" / "rocket" / "broken.JPEG").write_bytes(b"\xff\xd8 not a JPEG \xff\xd9")
    args = [
        f"run_dir={run}",
        f"source={source / 'val'}",
        "batch=2",
        "trainer.devices=2",
        "save_images=0",
        "trainer.progress=false",
    ]
    whole = tmp_path / "whole"
    predict_ok(*args, f"out={whole}")

    env = job_env(VISIONDIST_FAULT="predict_kill:1", VISIONDIST_TOOL="predict")
    proc = start_job([sys.executable, str(FAULT), *args], env=env)
    out = finish_job(proc, 240, "the killed prediction")
    assert proc.returncode != 0, out[-3000:]
    (stopped,) = (run / "predict").iterdir()
    parts = list((stopped / "parts").glob("rank*.jsonl"))
    assert parts and not (stopped / "predictions.csv").exists()
    # SIGKILL: nobody could say
    assert json.loads((stopped / "predict.json").read_text())["state"] == "running"

    again = predict_ok(*args)
    assert f"continuing the prediction in {stopped}" in again
    assert "continuing: " in again and "batches were predicted before" in again
    assert (stopped / "predictions.csv").read_bytes() == (whole / "predictions.csv").read_bytes()
    assert len(rows(stopped)) == 1 + 20
    reasons = (stopped / "unreadable.txt").read_text().splitlines()
    assert reasons[0] == "coffee/empty.JPEG: the file is empty", reasons
    assert reasons[1].startswith("rocket/broken.JPEG: "), reasons
    assert (
        "predicted 20 images (2 unreadable files skipped: unreadable.txt); this attempt: " in again
    )

    third = predict_ok(*args)
    assert f"complete: {stopped} already holds this prediction" in third
    assert [p.name for p in (run / "predict").iterdir()] == [stopped.name]
    # the same count of files, one of them another
    (source / "val" / "coffee" / "empty.JPEG").unlink()
    (source / "val" / "coffee" / "new.JPEG").write_bytes(b"")
    changed = predict_ok(*args)
    assert "complete:" not in changed and len(list((run / "predict").iterdir())) == 2


def test_bad_input_is_refused_before_any_rank_starts(classifier, tmp_path):
    run, data = classifier
    before = sorted((run / "predict").iterdir()) if (run / "predict").is_dir() else []
    empty = tmp_path / "empty"
    empty.mkdir()
    import torch

    # a torch.export program of someone else's (format=pt2 writes such, with visiondist.json
    # inside saying its inputs; this one says nothing)
    program = tmp_path / "model.pt2"
    torch.export.save(
        torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),)), str(program)
    )
    cases = [
        (
            [f"weights={program}", "model=vit_tiny", "data=shapes", f"source={data / 'val'}"],
            f"weights={program} is a torch.export program (tools/export.py format=pt2 writes "
            "such) that tools/export.py did not write",
        ),
        ([f"run_dir={run}", f"source={tmp_path / 'nowhere'}"], "no such file or folder"),
        ([f"run_dir={run}", f"source={empty}"], "the folder holds no images"),
        ([f"run_dir={run}", f"source={tmp_path}/*.jpg"], "the glob matches no images"),
        ([f"run_dir={run}"], "give source=<path>"),
        ([f"source={empty}"], "give run_dir=<run>"),
        (
            [f"run_dir={run}", f"source={data / 'val'}", "save_images=some"],
            "save_images=some: give a count",
        ),
        (
            [f"run_dir={run}", f"source={data / 'val'}", "classes=circle"],
            "keeps a detector's classes",
        ),
        (  # a detector's settings would change nothing a classifier writes
            [f"run_dir={run}", f"source={data / 'val'}", "score_thresh=0.9", "save_txt=true"],
            "score_thresh=0.9, save_txt=true: detector settings; vit_tiny is a classifier",
        ),
    ]
    for args, expected in cases:
        result = run_cli(args, timeout=120, script=PREDICT)
        assert result.returncode == 2, (args, result.stdout[-2000:])
        assert expected in result.stdout and result.stdout.count("error:") == 1, (
            args,
            result.stdout[-2000:],
        )
    after = sorted((run / "predict").iterdir()) if (run / "predict").is_dir() else []
    assert after == before  # no run dir for a refused command


def test_a_source_of_unreadable_files_alone_predicts_nothing_and_says_so(classifier, tmp_path):
    """Every file unreadable: the job runs (a file is only found unreadable when read), then ends
    with one error line naming why, exit code 2, and unreadable.txt names each file. The same
    command again (a script's retry) answers the same, not that the prediction is complete."""
    run, _ = classifier
    source = tmp_path / "photos"
    source.mkdir()
    (source / "broken.jpg").write_bytes(b"\xff\xd8 not a JPEG \xff\xd9")
    out = tmp_path / "out"
    result = run_cli(
        [f"run_dir={run}", f"source={source}", f"out={out}", "trainer.progress=false"],
        timeout=120,
        script=PREDICT,
    )
    assert result.returncode == 2, result.stdout[-2000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("error:"))
    assert line.startswith(f"error: predicted nothing: the only file of source={source} is "), line
    assert (out / "unreadable.txt").read_text().startswith("broken.jpg: ")
    again = run_cli(
        [f"run_dir={run}", f"source={source}", f"out={out}", "trainer.progress=false"],
        timeout=120,
        script=PREDICT,
    )
    assert again.returncode == 2 and line in again.stdout, again.stdout[-2000:]


def test_a_detector_predicts_its_evaluation_and_writes_coco_results_drawn_images_and_a_video(
    detector, tmp_path
):
    """The val folder at score_thresh=0 and the evaluation's batch: results.json equals the run's
    detections.json (with file names added); detections.jsonl has boxes in the original image's
    pixels with names and category ids; 2 ranks write the same files; classes= keeps only that
    class; a video of the val images is predicted and drawn; a class the model was not trained for
    is refused naming the run's classes."""
    import cv2

    run, data = detector
    out = tmp_path / "one"
    predict_ok(
        f"run_dir={run}",
        f"source={data / 'val'}",
        f"out={out}",
        "score_thresh=0",
        "batch=4",
        "save_images=2",
        "trainer.progress=false",
    )
    theirs = json.loads((run / "detections.json").read_text())
    ours = json.loads((out / "results.json").read_text())
    assert len(ours) == len(theirs) > 0
    assert [{k: v for k, v in d.items() if k != "file_name"} for d in ours] == theirs
    # predict.json records the detector's own settings, not a classifier's
    ask = json.loads((out / "predict.json").read_text())["request"]
    assert (ask["min_size"], ask["max_size"], ask["score_thresh"]) == (64, 64, 0.0)
    assert "topk" not in ask and "img_size" not in ask
    lines = [json.loads(line) for line in (out / "detections.jsonl").read_text().splitlines()]
    assert len(lines) == 9 and all(
        {"file", "width", "height", "detections"} <= line.keys() for line in lines
    )
    from safetensors import safe_open

    from visiondist.synthetic.shapes import SHAPE_CLASSES

    # what names the predictions' classes
    with safe_open(str(run / "model.safetensors"), "pt") as weights:
        labels = json.loads(weights.metadata()["labels"])
    assert labels == {
        str(k + 1): {"category_id": k + 1, "name": name} for k, name in enumerate(SHAPE_CLASSES)
    }
    names = set(SHAPE_CLASSES)
    for line in lines:
        for d in line["detections"]:
            x0, y0, x1, y1 = d["box"]
            assert 0 <= x0 <= x1 <= line["width"] and 0 <= y0 <= y1 <= line["height"]
            assert d["name"] in names and d["category_id"] == SHAPE_CLASSES.index(d["name"]) + 1, d
    assert len(list((out / "images").iterdir())) == 2

    two = tmp_path / "two"
    predict_ok(
        f"run_dir={run}",
        f"source={data / 'val'}",
        f"out={two}",
        "score_thresh=0",
        "batch=4",
        "save_images=0",
        "trainer.devices=2",
        "trainer.progress=false",
    )
    assert (two / "results.json").read_bytes() == (out / "results.json").read_bytes()

    first = lines[0]["detections"][0]["name"]
    only = tmp_path / "only"
    predict_ok(
        f"run_dir={run}",
        f"source={data / 'val'}",
        f"out={only}",
        "score_thresh=0",
        f"classes={first}",
        "save_images=0",
        "trainer.progress=false",
    )
    kept = [json.loads(line) for line in (only / "detections.jsonl").read_text().splitlines()]
    assert {d["name"] for line in kept for d in line["detections"]} == {first}
    refused = run_cli(
        [f"run_dir={run}", f"source={data / 'val'}", "classes=zebra"], timeout=120, script=PREDICT
    )
    assert (
        refused.returncode == 2 and "classes=zebra: this model was trained for " in refused.stdout
    )

    video = tmp_path / "clip.mp4"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"mp4v"), 10, (64, 64))
    for image in sorted((data / "val").iterdir())[:6]:
        writer.write(cv2.resize(cv2.imread(str(image)), (64, 64)))
    writer.release()
    clip = tmp_path / "clip"
    printed = predict_ok(
        f"run_dir={run}",
        f"source={video}",
        f"out={clip}",
        "vid_stride=2",
        "score_thresh=0",
        "trainer.progress=false",
    )
    frames = [json.loads(line) for line in (clip / "detections.jsonl").read_text().splitlines()]
    assert [f["file"] for f in frames] == ["clip.mp4#0", "clip.mp4#2", "clip.mp4#4"]
    assert "clip_predicted.mp4" in printed
    drawn = cv2.VideoCapture(str(clip / "clip_predicted.mp4"))
    assert int(drawn.get(cv2.CAP_PROP_FRAME_COUNT)) == 3
    drawn.release()


def test_a_detectors_torchscript_export_prints_its_check_line(detector, tmp_path):
    """Every export format prints its check: a scripted torchvision detector's boxes on the run's
    val images against PyTorch's, with none of TorchScript's own warnings."""
    run, _ = detector
    out = tmp_path / "frcnn.pt"
    result = run_cli(
        [f"run_dir={run}", "format=torchscript", f"out={out}"],
        timeout=180,
        script=REPO / "tools" / "export.py",
    )
    assert result.returncode == 0, result.stdout[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[-2:] == [f"  {out}", lines[-1]] and "Warning" not in result.stdout, result.stdout
    assert (
        lines[-1].startswith("  TorchScript vs PyTorch: ")
        and "boxes of 4 val images compared, max abs difference 0" in lines[-1]
    ), result.stdout


def test_a_detectors_weights_predict_from_python_as_the_tool_with_the_model_alone(
    detector, tmp_path
):
    """`visiondist.predict(source, weights=<a detector's file>, model=...)` composes as
    tools/predict.py does: no data named, so the detector's (data=detection), not the default
    classification set's refusal; the same boxes as the tool writes for the same file."""
    import shutil

    import visiondist

    run, data = detector
    weights = shutil.copy(run / "model.safetensors", tmp_path / "frcnn.safetensors")
    image = sorted((data / "val").rglob("*.jpg"))[0]
    size = ["data.min_size=64", "data.max_size=64", "data.num_classes=6"]
    (result,) = visiondist.predict(
        [image], *size, weights=weights, model="fasterrcnn_mobilenet_v3", score_thresh=0.0
    )
    printed = predict_ok(
        f"weights={weights}",
        "model=fasterrcnn_mobilenet_v3",
        *size,
        f"source={image}",
        f"out={tmp_path / 'tool'}",
        "score_thresh=0",
    )
    assert "predicted 1 image" in printed
    rows = [
        json.loads(line)
        for line in (tmp_path / "tool" / "detections.jsonl").read_text().splitlines()
    ]
    tool = [d["box"] for d in rows[0]["detections"]]
    assert len(tool) == len(result.detections)
    for got, want in zip((d["box"] for d in result.detections), tool):
        assert got == pytest.approx(want, abs=1e-3)  # round-off of another batch
    assert result.detections  # score_thresh=0: the 1-step detector's boxes
