"""data.interpolation in the transforms and the config check; the export's sidecar gives timm the
run's eval preprocessing; the ONNX check's report of what it compared."""

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from helpers import REPO
from omegaconf import OmegaConf

from visiondist.cli import load_config
from visiondist.config import ConfigError


def test_interpolation_defaults_to_bilinear_and_other_names_are_refused():
    assert load_config(REPO / "configs", [], inputs=None).data.interpolation == "bilinear"
    assert (
        load_config(
            REPO / "configs", ["data=imagenet", "data.root=/x", "data.num_classes=10"], inputs=None
        ).data.interpolation
        == "bilinear"
    )
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "configs", ["data.interpolation=nearest"], inputs=None)
    assert (
        str(info.value)
        == "data.interpolation='nearest' is not supported: use one of bilinear, bicubic"
    )


@pytest.mark.parametrize(
    "name, flag",
    [(None, cv2.INTER_LINEAR), ("bilinear", cv2.INTER_LINEAR), ("bicubic", cv2.INTER_CUBIC)],
)
def test_classification_transforms_resize_with_the_setting(name, flag):
    import albumentations as A

    from visiondist.data.transforms import classification_transforms

    cfg = dict(train_crop_scale=[0.5, 1.0], hflip=0.5, crop_pct=0.875)
    if name is not None:
        cfg["interpolation"] = name
    train = classification_transforms(OmegaConf.create(cfg), True, 32)
    val = classification_transforms(OmegaConf.create(cfg), False, 32)
    assert train.transforms[0].interpolation == flag and val.interpolation == flag
    # bilinear is what the transforms did before the setting existed: albumentations' own default
    assert (
        A.SmallestMaxSize(max_size=8).interpolation
        == A.RandomResizedCrop(size=(8, 8)).interpolation
        == cv2.INTER_LINEAR
    )


def test_bicubic_changes_the_pixels_bilinear_does_not():
    from visiondist.data.transforms import ClassificationTransform

    image = np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8)
    base = dict(train_crop_scale=[0.5, 1.0], hflip=0.5, crop_pct=0.875)
    out = {
        name: ClassificationTransform(
            OmegaConf.create({**base, **({"interpolation": name} if name else {})}), False, 32, 0
        )(image, 0, 0)
        for name in (None, "bilinear", "bicubic")
    }
    assert torch.equal(out[None], out["bilinear"]) and not torch.equal(
        out["bilinear"], out["bicubic"]
    )


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            [],
            {
                "input_size": [3, 64, 64],
                "mean": [0.5] * 3,
                "std": [0.25] * 3,
                "crop_pct": 1.0,
                "interpolation": "bilinear",
            },
        ),
        (
            ["data.interpolation=bicubic", "data.crop_pct=0.9", "data.img_size=48"],
            {
                "input_size": [3, 48, 48],
                "mean": [0.5] * 3,
                "std": [0.25] * 3,
                "crop_pct": 0.9,
                "interpolation": "bicubic",
            },
        ),
    ],
)
def test_exported_create_kwargs_give_timm_the_runs_data_config(overrides, expected):
    import timm
    from PIL import Image

    from visiondist.checkpoint.export.preprocessing import sidecar
    from visiondist.checkpoint.export.trained import Trained

    cfg = load_config(
        REPO / "configs", ["model.depth=1", "model.num_heads=2", *overrides], inputs=None
    )
    classes = ["circle", "square", "triangle", "star", "cross", "ring"]
    info = json.loads(
        json.dumps(sidecar(Trained(cfg, None, Path("run/checkpoints/step_1"), 1, classes)))
    )
    model = timm.create_model(**info["create"], pretrained=False)
    for use_test_size in (False, True):
        resolved = timm.data.resolve_model_data_config(model, use_test_size=use_test_size)
        assert {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in resolved.items()} == {
            **expected,
            "crop_mode": "center",
        }
    assert model.num_classes == 6 and list(model.pretrained_cfg["label_names"]) == classes
    assert (info["input_size"], info["crop_pct"], info["interpolation"]) == (
        expected["input_size"][1],
        expected["crop_pct"],
        expected["interpolation"],
    )
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
    x = transform(Image.fromarray(np.zeros((70, 90, 3), dtype=np.uint8)))
    assert x.shape == (3, expected["input_size"][1], expected["input_size"][1])
    assert torch.allclose(x, torch.full_like(x, -2.0))  # (0 - 0.5) / 0.25: the run's mean and std
    assert model(x[None]).shape == (1, 6)


@pytest.mark.parametrize(
    "h, w, crop_pct",
    [(32, 47, 1.0), (47, 32, 1.0), (64, 80, 0.875), (80, 64, 0.875), (61, 93, 0.9), (93, 61, 0.9)],
)
def test_timms_eval_transform_crops_the_pixels_the_run_scores_whatever_the_shape(h, w, crop_pct):
    """The run's eval crop against timm's transform for the exported settings, on images that are
    not square: where nothing is resized the pixels are the same (a centre offset of 7.5 is 8 in
    torchvision's rounding, as in the run's); resized, Pillow's and OpenCV's bilinear filters
    differ by a level or two on a smooth image, where a crop one pixel off differs by up to 11."""
    import timm.data
    from PIL import Image

    from visiondist.data.transforms import ClassificationTransform

    image = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    if crop_pct != 1.0:
        image = cv2.GaussianBlur(image, (0, 0), 3)
    cfg = OmegaConf.create(dict(train_crop_scale=[0.5, 1.0], hflip=0.5, crop_pct=crop_pct))
    ours = ClassificationTransform(cfg, False, 32, 0)(image, 0, 0).numpy().astype(int)
    timms = timm.data.create_transform(
        input_size=(3, 32, 32), crop_pct=crop_pct, interpolation="bilinear", mean=0, std=1
    )(Image.fromarray(image))
    theirs = (timms.permute(1, 2, 0).numpy() * 255).round().astype(int)
    diff = np.abs(ours - theirs)
    if crop_pct == 1.0:
        assert diff.max() == 0
    else:
        assert diff.max() <= 2 and diff.mean() < 0.3, (diff.max(), diff.mean())


def test_onnx_check_says_what_it_compared():
    from visiondist.checkpoint.export.onnx_check import RuntimeCheck

    assert RuntimeCheck(
        2.1e-5, "3 val images (a.jpg, b.jpg, c.jpg in val)", boxes=37, onnx_boxes=37
    ).summary() == (
        "ONNX Runtime vs PyTorch: 37 boxes compared, max abs difference 2.10e-05 "
        "(on 3 val images (a.jpg, b.jpg, c.jpg in val))"
    )
    empty = RuntimeCheck(0.0, "a random image", boxes=0, onnx_boxes=0).summary()
    assert "0 boxes compared" in empty and "checks nothing" in empty
    lowered = RuntimeCheck(
        1e-5, "a random image", boxes=5, onnx_boxes=5, lowered_from={"rpn": 0.05, "box": 0.9}
    )
    assert (
        "5 boxes compared" in lowered.summary()
        and "no box passed the file's score thresholds (rpn 0.05, box 0.9, kept in the file)"
        in lowered.summary()
    )
    assert "the outputs differ" in RuntimeCheck(float("inf"), "x", boxes=5, onnx_boxes=4).summary()
    # the same total, other counts on two images (an int8 file: 5 and 4 against 4 and 5)
    swapped = RuntimeCheck(
        float("inf"), "x", boxes=17, onnx_boxes=17, counts_differ=2, images=4, precision="int8"
    ).summary()
    said = (
        "the outputs differ: ONNX Runtime returned 17 boxes, PyTorch 17 in all, and other counts "
        "on 2 of the 4 images (on x; the int8 network's scores move boxes across the score "
        "threshold and NMS)"
    )
    assert "inf" not in swapped and said in swapped
    far = RuntimeCheck(26.3, "3 val images", boxes=300, onnx_boxes=300, score_spread=0.81).summary()
    assert (
        "max abs difference 2.63e+01" in far
        and "warning: more than float round-off (0.01 px), with scores "
        "spread over 0.81: the exported graph does not compute what PyTorch does"
        in far
    )
    # a 4-step detector's export: its scores tie, and top-k's choice among them is no fault of the
    # export
    tied = RuntimeCheck(
        26.3, "3 val images", boxes=300, onnx_boxes=300, score_spread=2.9e-3
    ).summary()
    assert (
        "warning" not in tied
        and "expected for these weights: every score lies within 2.9e-03" in tied
    )
    assert RuntimeCheck(1e-6, "2 random images").summary() == (
        "ONNX Runtime vs PyTorch: logits of 2 random images compared, max abs difference 1.00e-06"
    )


def test_detections_are_compared_as_sets():
    from visiondist.checkpoint.export.onnx_check import _box_diff

    g = torch.Generator().manual_seed(0)
    boxes, labels, scores = (
        torch.rand(6, 4, generator=g) * 50,
        torch.tensor([1, 2, 1, 3, 2, 1]),
        torch.rand(6),
    )
    order = torch.tensor([1, 0, 2, 5, 4, 3])  # tied scores may come out in another order
    got = [boxes[order].numpy(), labels[order].numpy(), scores[order].numpy()]
    assert _box_diff([boxes, labels, scores], got) == 0.0
    got[0] = got[0] + np.float32(1e-3)
    assert _box_diff([boxes, labels, scores], got) == pytest.approx(1e-3, rel=1e-3)
    assert _box_diff([boxes, labels, scores], [a[:5] for a in got]) == float("inf")
