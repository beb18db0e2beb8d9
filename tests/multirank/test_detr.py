"""DETR-class detectors (transformers' RT-DETRv2, D-FINE, RF-DETR) end to end through the tools:
training with the multi-scale schedule, exact resume, evaluation on 1, 2 and 3 ranks equal to each
other and to pycocotools on the written detections, the exported weights; DDP with accumulation
(under fp16 and fp32), resumed on another world size, the from_pretrained directory and the ONNX
file."""

import json
import re

import pytest
from helpers import REPO, assert_same_detections, losses_of, run_cli

from visiondist.observe.metrics import read_metrics

pytest.importorskip("transformers")

# Loader workers off (data.num_workers=0): these tests are about the model's path through the tools;
# the workers' square resize is the same function, tested against the image processors in
# tests/unit/test_detr_models.py. 64 px images: 84 candidate positions at strides 8 / 16 / 32, so 50
# queries (the published models: 640 px, 300); training batches at 64 or 96 px (the multi-scale
# schedule's draw; the published one: 480-800 around 640)
DETR = [
    "model=rtdetr_v2_r18",
    "model.img_size=64",
    "model.multi_scale=[64,96]",
    "model.num_queries=50",
    "data=shapes_coco",
    "data.synthetic.train_images=16",
    "data.synthetic.val_images=10",
    "data.synthetic.image_size=64",
    "data.min_size=64",
    "data.max_size=64",
    "data.batch_size=4",
    "data.eval_batch_size=4",
    "data.num_workers=0",
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "trainer.accelerator=cpu",
    "trainer.progress=false",
    "trainer.loggers=[csv]",
    "schedule.warmup_steps=1",
]


def _stats(path):
    return {
        k: v
        for k, v in json.loads(path.read_text()).items()
        if k.startswith("val_") and "class" not in k
    }


def test_rtdetr_trains_resumes_exactly_evaluates_the_same_on_1_2_3_ranks_and_exports(tmp_path):

    data = tmp_path / "shapes_coco"
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    out = run_cli([*DETR, f"data.root={data}", f"trainer.run_dir={whole}"], timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]
    # 20.2M at COCO's 80 classes (published: 20M)
    assert "model rtdetr_v2_r18: 20.09M parameters" in out.stdout
    final = [r for r in read_metrics(whole / "metrics.csv") if r.get("val_mAP") is not None][-1]
    # every query of every val image, as the library post-processes
    assert final["val_detections"] == 10 * 50

    # stopped after step 2 (the schedule still spans 3 steps) and continued: step 3's loss is the
    # uninterrupted one's
    out = run_cli(
        [*DETR, f"data.root={data}", f"trainer.run_dir={stopped}", "trainer.stop_at_step=2"],
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:]
    out = run_cli([*DETR, f"data.root={data}", f"trainer.run_dir={stopped}"], timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]
    a, b = losses_of(whole), losses_of(stopped)
    assert sorted(a) == sorted(b) == [1, 2, 3] and b == pytest.approx(a, rel=1e-5)

    stats = _evaluated_alike_on_1_2_3_ranks(whole, data)
    assert {k: v for k, v in final.items() if k in stats} == {
        k: stats[k] for k in final if k in stats
    }

    _exported_predicts_as_trained(whole, tmp_path / "rtdetr.safetensors")


def _evaluated_alike_on_1_2_3_ranks(run_dir, data, ranks=(1, 2, 3), per_rank: int = 1) -> dict:
    """tools/eval.py on 1, 2 and 3 ranks (or `ranks`): the same detections (every float) and the
    same 12 stats, which pycocotools gives too on the written detections.json (one image per batch
    on every rank: a batch's size changes the convolutions' rounding in the last bits, and the test
    compares every detection's float). Returns the stats."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from visiondist.evaluation.coco_scoring import STAT_NAMES

    gt = COCO(str(data / "annotations" / "instances_val.json"))
    seen = {}
    for n in ranks:
        out = run_cli(
            [
                f"run_dir={run_dir}",
                f"trainer.devices={n}",
                f"parallel.dp={n}",
                "data.batch_size=12",
                f"data.eval_batch_size={n * per_rank}",
            ],
            timeout=300,
            script=REPO / "tools" / "eval.py",
        )
        assert out.returncode == 0, out.stdout[-4000:]
        run = sorted((run_dir / "eval").iterdir())[-1]
        detections = json.loads((run / "detections.json").read_text())
        key = sorted(
            (d["image_id"], d["category_id"], tuple(d["bbox"]), d["score"]) for d in detections
        )
        evaluator = COCOeval(gt, gt.loadRes(str(run / "detections.json")), iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
        stats = _stats(run / "eval.json")
        assert dict(zip(STAT_NAMES, map(float, evaluator.stats))) == {
            k: stats[f"val_{k}"] for k in STAT_NAMES
        }
        seen[n] = (key, stats)
    assert all(seen[n] == seen[ranks[0]] for n in ranks)
    return seen[ranks[0]][1]


def _evaluated_on_2_ranks_as_in_training(run_dir, data, final: dict) -> None:
    """tools/eval.py on 2 ranks against the run's own evaluation after its last step (one rank,
    batches of `TRAINED_EVAL_BATCH` = 5): the same stats, which pycocotools gives too on the
    detections eval.py wrote, and the same detections of every image, compared as sets within
    round-off. Both evaluate batches of 5 images (the 10 val images as 2 batches on one rank, as one
    batch on each of 2): another batch shape may take another convolution algorithm, whose rounding
    moves a barely trained detector's near-tied scores by more than round-off on some CPUs and not
    on others. Every float of 1, 2 and 3 ranks (shards of 4, 3 and 3) at one batch size: the RT-DETR
    test's `_evaluated_alike_on_1_2_3_ranks`; the sharding and gathering are the same code for every
    variant, the post-processing each variant's own. `final`: the metrics.csv row of the run's last
    evaluation."""
    stats = _evaluated_alike_on_1_2_3_ranks(run_dir, data, ranks=(2,), per_rank=TRAINED_EVAL_BATCH)
    assert {k: v for k, v in final.items() if k in stats} == {
        k: stats[k] for k in final if k in stats
    }
    trained, evaluated = (
        by_image(p)
        for p in (
            run_dir / "detections.json",
            sorted((run_dir / "eval").iterdir())[-1] / "detections.json",
        )
    )
    assert sorted(trained) == sorted(evaluated) and len(trained) == 10
    for image in trained:
        assert_same_detections(trained[image], evaluated[image], box_atol=1e-3, score_atol=1e-4)


# val images per batch of the runs _evaluated_on_2_ranks_as_in_training compares
TRAINED_EVAL_BATCH = 5


def by_image(path) -> dict:
    """A COCO results file's detections as {image id: {"boxes", "labels" (category ids),
    "scores"}}."""
    import collections

    images = collections.defaultdict(lambda: {"boxes": [], "labels": [], "scores": []})
    for d in json.loads(path.read_text()):
        images[d["image_id"]]["boxes"].append(d["bbox"])
        images[d["image_id"]]["labels"].append(d["category_id"])
        images[d["image_id"]]["scores"].append(d["score"])
    return images


def _exported_predicts_as_trained(run, exported):
    """tools/export.py's file loads strictly into the model the config builds and predicts exactly
    what the run's weights do."""
    import torch
    from omegaconf import OmegaConf

    from visiondist.checkpoint.export.trained import load_trained
    from visiondist.models import build_model

    out = run_cli(
        [f"run_dir={run}", f"out={exported}"], timeout=300, script=REPO / "tools" / "export.py"
    )
    assert out.returncode == 0, out.stdout[-4000:]
    trained = load_trained(run)
    # the sidecar gives the model's own input scaling: ImageNet's mean / std for RF-DETR, pixels in
    # [0, 1] for the rest
    sidecar = json.loads(exported.with_suffix(".json").read_text())
    normalizes = trained.cfg.model.arch.startswith("rfdetr")
    assert (sidecar["mean"], sidecar["std"]) == (
        ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
        if normalizes
        else ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    )
    from visiondist.models.detr_archs import ARCHS

    # which class format=hf feeds
    assert f"{ARCHS[trained.cfg.model.arch].model}.from_pretrained" in sidecar["usage"]
    fresh = build_model(OmegaConf.merge(trained.cfg.model, {"weights": str(exported)})).eval()
    image = [torch.rand(3, 64, 80, generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        want, got = trained.model.eval()(image)[0], fresh(image)[0]
    for k in ("boxes", "scores", "labels"):
        assert torch.equal(want[k], got[k]), k


@pytest.mark.parametrize(
    "model,queries,size",
    [
        ("dfine_s", 50, r"10\.\d+M"),
        ("rtdetr_v2_r50", 50, r"4\d\.\d+M"),
        ("rfdetr_small", 16, r"3\d\.\d+M"),
    ],
)
def test_the_larger_variants_train_evaluate_on_2_ranks_and_export(tmp_path, model, queries, size):
    """D-FINE-S, RT-DETRv2-L and RF-DETR-S through the same tools (the other three: the tests above
    and below): every val image gets the queries' detections, evaluated on 2 ranks as in training
    and as pycocotools scores the written detections, and the exported file loads strictly into the
    config's model. One training layout each (plain, one rank): the layouts are the wrapper's,
    tested on the smaller variants; these runs are about each variant's own values. Stopped after
    step 1 and continued: D-FINE-S, whose frozen BatchNorms are its own state to resume; the others
    resume as their family's smaller variant does (RT-DETRv2-S, RF-DETR-N: the tests above and
    below). (64 px: RF-DETR-S's 4 x 4 patch grid gives 16 candidate positions.)"""
    run, data = tmp_path / "run", tmp_path / "data"
    args = [
        a
        for a in DETR
        if not a.startswith(
            (
                "model=",
                "model.num_queries",
                "model.multi_scale",
                "trainer.max_steps",
                "data.eval_batch_size",
            )
        )
    ]
    multi_scale = (
        "model.multi_scale=[64,96]" if model.startswith("rtdetr") else "model.multi_scale=null"
    )
    args = [
        f"model={model}",
        f"model.num_queries={queries}",
        multi_scale,
        *args,
        "trainer.max_steps=2",
        f"data.eval_batch_size={TRAINED_EVAL_BATCH}",
        f"data.root={data}",
        f"trainer.run_dir={run}",
    ]
    # fine-tuned from a from_pretrained directory with the library's frozen BatchNorms,
    if model == "dfine_s":
        # which a resume (reading no weights but the checkpoint's) builds frozen again from the
        # checkpoint's keys
        from helpers import detr_model_cfg

        from visiondist.models.detr_library import build_detr

        build_detr(
            detr_model_cfg(model, kwargs={"freeze_backbone_batch_norms": True})
        ).model.save_pretrained(tmp_path / "pretrained")
        args.append(f"model.weights={tmp_path / 'pretrained'}")
    if model == "dfine_s":
        out = run_cli([*args, "trainer.stop_at_step=1"], timeout=300)
        assert out.returncode == 0, out.stdout[-4000:]
    out = run_cli(args, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:]
    assert ("resum" in out.stdout.lower()) == (model == "dfine_s"), out.stdout[-2000:]
    assert bool(
        re.search(r"step_1 saved \d+ BatchNorms frozen: the model has them frozen too", out.stdout)
    ) == (model == "dfine_s"), out.stdout[-2000:]
    assert re.search(rf"model {model}: {size} parameters", out.stdout), out.stdout[-2000:]
    losses = losses_of(run)
    assert sorted(losses) == [1, 2] and all(v == v and v > 0 for v in losses.values())
    final = [r for r in read_metrics(run / "metrics.csv") if r.get("val_mAP") is not None][-1]
    assert final["val_detections"] == 10 * queries
    _evaluated_on_2_ranks_as_in_training(run, data, final)
    _exported_predicts_as_trained(run, tmp_path / f"{model}.safetensors")


@pytest.mark.parametrize(
    "model,precision,queries", [("rfdetr_nano", "32", 16), ("dfine_n", "16", 20)]
)
def test_ddp_accumulation_precision_resume_on_another_world_size_and_library_exports(
    tmp_path, model, precision, queries
):
    """D-FINE-N under fp16 (autocast and dynamic loss scaling, whose state the checkpoint carries),
    RF-DETR-N in fp32: 2 ranks with 2 accumulation steps, stopped after step 1, continued on 1 rank
    (the checkpoint reshards; the schedule and data order go on), evaluated on 2 ranks as in
    training and as pycocotools scores the written detections; the run exported as the directory
    transformers' from_pretrained reads (strict, and predicting what the run's weights do) and
    (D-FINE-N) as ONNX checked by ONNX Runtime on the run's val images. (64 px: RF-DETR's 4 x 4
    patch grid gives 16 candidate positions, D-FINE-N's strides 16 / 32 give 20.)"""
    import torch

    run = tmp_path / "run"
    args = [
        a for a in DETR if not a.startswith(("model=", "model.num_queries", "model.multi_scale"))
    ]
    args = [
        f"model={model}",
        f"model.num_queries={queries}",
        "model.multi_scale=null",
        *args,
        f"data.root={tmp_path / 'data'}",
        f"trainer.run_dir={run}",
        f"trainer.precision={precision}",
        "trainer.grad_accum=2",
        "data.batch_size=8",
    ]
    out = run_cli(
        [*args, "trainer.devices=2", "parallel.dp=2", "trainer.stop_at_step=1"], timeout=300
    )
    assert out.returncode == 0, out.stdout[-4000:]
    out = run_cli(
        [
            *args,
            "trainer.max_steps=2",
            "trainer.devices=1",
            "parallel.dp=1",
            f"data.eval_batch_size={TRAINED_EVAL_BATCH}",
        ],
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:]
    losses = losses_of(run)
    assert sorted(losses) == [1, 2] and all(v == v and v > 0 for v in losses.values())
    # the loss scale went on from the checkpoint: 2^16 halved once per overflow, over both
    if precision == "16":
        # attempts
        overflows = (run / "train.log").read_text().count("fp16 gradient overflow at step")
        summary = json.loads((run / "summary.json").read_text())
        assert overflows >= 1 and summary["fp16 loss scale"] == 2.0**16 / 2**overflows, (
            overflows,
            summary,
        )
        assert summary["skipped steps (fp16 overflow)"] == overflows
    final = [r for r in read_metrics(run / "metrics.csv") if r.get("val_mAP") is not None][-1]
    assert final["val_detections"] == 10 * queries
    _evaluated_on_2_ranks_as_in_training(run, tmp_path / "data", final)

    from transformers import AutoImageProcessor, AutoModelForObjectDetection

    from visiondist.checkpoint.export.trained import load_trained

    hf = tmp_path / "hf"
    out = run_cli(
        [f"run_dir={run}", "format=hf", f"out={hf}"],
        timeout=300,
        script=REPO / "tools" / "export.py",
    )
    assert out.returncode == 0, out.stdout[-4000:]
    library, info = AutoModelForObjectDetection.from_pretrained(hf, output_loading_info=True)
    assert not any(info.values())
    processor = AutoImageProcessor.from_pretrained(hf)
    trained = load_trained(run)
    image = torch.rand(3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = trained.model([image])[0]
        got = processor.post_process_object_detection(
            library.eval()(pixel_values=trained.model.pixels([image])),
            threshold=0.0,
            target_sizes=[(64, 64)],
        )[0]
    # two implementations of one network on one input: equal to round-off, compared as sets
    # (near-tied scores of a barely trained detector may come out in another order)
    assert_same_detections(
        want, dict(got, labels=got["labels"] + 1), box_atol=1e-3, score_atol=1e-5
    )

    # the directory starts a new run (model.weights=, checked before any rank starts); another
    # variant is refused
    other = "rfdetr_small" if model == "rfdetr_nano" else "dfine_s"
    args = [a for a in args if not a.startswith("trainer.run_dir=")]
    refused = run_cli(
        [
            *[a for a in args if a != f"model={model}"],
            f"model={other}",
            f"model.weights={hf}",
            f"trainer.run_dir={tmp_path / 'refused'}",
        ],
        timeout=300,
    )
    assert (
        refused.returncode == 2
        and f"is another variant than model={other}" in refused.stdout + refused.stderr
    )
    assert f"use model={model}" in refused.stdout + refused.stderr
    if model == "dfine_n":  # the same code for either model: once is enough for CI's time
        again = run_cli(
            [
                *args,
                f"model.weights={hf}",
                "trainer.max_steps=1",
                f"trainer.run_dir={tmp_path / 'again'}",
            ],
            timeout=300,
        )
        assert again.returncode == 0, again.stdout[-4000:]
        assert f"tensors loaded from {hf}" in again.stdout + again.stderr

    # tools/predict.py on the exported directory, as a user of it would: the run's own
    if model == "dfine_n":
        # detections of its val images (the class names from config.json, the category ids from the
        # annotation file)
        out = tmp_path / "predicted"
        predicted = run_cli(
            [
                *args,
                f"weights={hf}",
                f"source={tmp_path / 'data' / 'val'}",
                f"out={out}",
                "score_thresh=0",
                "batch=4",
                "save_images=1",
            ],
            timeout=300,
            script=REPO / "tools" / "predict.py",
        )
        assert predicted.returncode == 0, predicted.stdout[-4000:]
        trained, predicted = by_image(run / "detections.json"), by_image(out / "results.json")
        assert sorted(trained) == sorted(predicted) and len(predicted) == 10
        for image in trained:
            assert_same_detections(trained[image], predicted[image], box_atol=1e-3, score_atol=1e-4)
        assert len(list((out / "images").iterdir())) == 1

    # the tool's ONNX path is one for every family, whose graphs tests/unit/test_detr_models.py
    if model == "dfine_n":
        # compares with PyTorch each: once here is enough for CI's time
        out = run_cli(
            [f"run_dir={run}", "format=onnx", f"out={tmp_path / 'm.onnx'}"],
            timeout=300,
            script=REPO / "tools" / "export.py",
        )
        assert out.returncode == 0, out.stdout[-4000:]
        # 4 of its 10 val images, in one batch
        assert re.search(rf"ONNX Runtime vs PyTorch: {4 * queries} boxes compared", out.stdout), (
            out.stdout[-2000:]
        )
