"""Fine-tuning from a timm name, end to end and offline: the weights come from a Hugging Face cache
built here in huggingface_hub's layout (HF_HUB_OFFLINE=1: nothing is downloaded), then train,
evaluate and export run on the result."""

import json
import shutil

import pytest
import torch
from helpers import REPO, hf_cache_with, losses_of, train_args, train_ok
from safetensors.torch import load_file

from visiondist.observe.metrics import read_metrics

NAME = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"


def test_fine_tune_from_a_cached_timm_name_offline(tmp_path, tiny_shapes, monkeypatch):
    """The run starts from the cached file (after one AdamW step of lr 1e-3 every block weight is
    within 1.5e-3 of it; a fresh start would be ~0.02 away), its position embedding resampled from
    14 x 14 to 2 x 2 patches and a new 6-class head; the data settings the command line leaves alone
    come from the weights' pretrained config (mean / std 0.5, crop 0.9, bicubic) and reach the
    export's timm config; eval and export read the run."""
    import timm
    from timm.layers import resample_abs_pos_embed

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    torch.manual_seed(7)
    source = timm.create_model("vit_tiny_patch16_224", pretrained=False).state_dict()
    hf_cache_with(tmp_path / "hf", NAME, source)
    run = tmp_path / "run"
    common = [
        "model.depth=12",
        f"model.init_from=timm/{NAME}",
        "optim.lr=1e-3",
        "optim.weight_decay=0",
        "schedule.warmup_steps=0",
        "trainer.clip_grad=0",
    ]
    out = train_ok(*train_args(tiny_shapes, run, *common, "trainer.max_steps=1"))
    assert f"model.init_from=timm/{NAME}: its pretrained config sets data.std=[0.5,0.5,0.5]" in out
    assert "data.crop_pct=0.9 data.interpolation=bicubic" in out
    assert "pos_embed resampled from 14 x 14 to 2 x 2 patches" in out
    assert "head.weight, head.bias re-initialised" in out

    train_ok(f"run_dir={run}", script=REPO / "tools" / "export.py")
    exported = load_file(run / "export" / "model.safetensors")  # timm's keys
    expected = dict(
        source,
        pos_embed=resample_abs_pos_embed(source["pos_embed"], new_size=[2, 2], num_prefix_tokens=1),
    )
    for key, value in exported.items():
        if key.startswith("head."):
            assert value.shape[0] == 6
        else:
            assert (value - expected[key]).abs().max() <= 1.5e-3, key
    info = json.loads((run / "export" / "model.json").read_text())
    model = timm.create_model(**info["create"], pretrained=False)
    model.load_state_dict(exported, strict=True)
    data = timm.data.resolve_model_data_config(model)
    assert (tuple(data["mean"]), tuple(data["std"]), data["crop_pct"], data["interpolation"]) == (
        (0.5,) * 3,
        (0.5,) * 3,
        0.9,
        "bicubic",
    )
    assert tuple(data["input_size"]) == (3, 32, 32)

    train_ok(f"run_dir={run}", "trainer.progress=false", script=REPO / "tools" / "eval.py")
    evaluated = json.loads(next((run / "eval").rglob("eval.json")).read_text())
    final = [r for r in read_metrics(run / "metrics.csv") if r["val_loss"] is not None][-1]
    # the run's weights, read back under its data settings
    assert evaluated["val_top1"] == final["val_top1"]
    assert evaluated["val_loss"] == pytest.approx(final["val_loss"], rel=1e-5)

    # continued where the pretrained file is gone (a requeued job on another node): the checkpoint
    # is all it reads
    shutil.rmtree(tmp_path / "hf")
    out = train_ok(*train_args(tiny_shapes, run, *common, "trainer.max_steps=2"))
    assert "resumed from" in out and sorted(losses_of(run)) == [1, 2]


def test_detector_from_torchvision_weights_by_name_trains_evaluates_and_exports(
    tmp_path, monkeypatch
):
    """`model.weights=FasterRCNN_MobileNet_V3_Large_FPN_Weights.COCO_V1` from torch hub's cache
    (built here, offline): the run trains with torchvision's frozen BatchNorms and a new 6-class
    head, and its checkpoint evaluates and exports (the frozen BatchNorms, which have no batch
    counters, are rebuilt from the saved keys)."""
    import torchvision
    from helpers import torch_hub_cache_with
    from test_detection_train import DETECT
    from torchvision.models.detection import FasterRCNN_MobileNet_V3_Large_FPN_Weights as W

    from visiondist.models.weights import freeze_batchnorms

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("VISIONDIST_OFFLINE", "1")
    torch.manual_seed(3)
    coco = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None
    )
    freeze_batchnorms(coco.backbone.body)
    torch_hub_cache_with(tmp_path / "torch", W.COCO_V1.url, coco.state_dict())
    run = tmp_path / "run"
    out = train_ok(
        *DETECT,
        f"data.root={tmp_path / 'data'}",
        f"trainer.run_dir={run}",
        "model.weights=FasterRCNN_MobileNet_V3_Large_FPN_Weights.COCO_V1",
    )
    assert (
        "roi_heads.box_predictor.bbox_pred, roi_heads.box_predictor.cls_score re-initialised" in out
    )
    saved = load_file(run / "model.safetensors")
    assert not any(
        k.endswith("num_batches_tracked") for k in saved if k.startswith("backbone.body.")
    )
    torch.testing.assert_close(
        saved["backbone.body.0.0.weight"],
        coco.state_dict()["backbone.body.0.0.weight"],
        rtol=0,
        atol=0,
    )  # the stem is frozen: still the file's
    out = train_ok(f"run_dir={run}", script=REPO / "tools" / "eval.py")
    assert out.count("Average ") == 12
    train_ok(f"run_dir={run}", script=REPO / "tools" / "export.py")
    # as the sidecar says: plain builder
    exported = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        **json.loads((run / "export" / "model.json").read_text())["kwargs"]
    )
    exported.load_state_dict(load_file(run / "export" / "model.safetensors"), strict=True)

    # continued without the file: the checkpoint and the frozen layout suffice
    shutil.rmtree(tmp_path / "torch")
    out = train_ok(
        *DETECT,
        f"data.root={tmp_path / 'data'}",
        f"trainer.run_dir={run}",
        "trainer.max_steps=3",
        "model.weights=FasterRCNN_MobileNet_V3_Large_FPN_Weights.COCO_V1",
    )
    assert "resumed from" in out
    resumed = load_file(run / "model.safetensors")
    torch.testing.assert_close(
        resumed["backbone.body.0.0.weight"],
        coco.state_dict()["backbone.body.0.0.weight"],
        rtol=0,
        atol=0,
    )  # still frozen after the resume
