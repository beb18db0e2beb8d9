"""Detector builders: every torchvision architecture builds offline with the dataset's classes and
trains a step; local weights load exactly; the detection augmentation moves boxes with the
pixels."""

import numpy as np
import pytest
import torch
from helpers import bf16_box_distances
from omegaconf import OmegaConf

from visiondist.data.transforms import DetectionTransform, resize_keep_aspect
from visiondist.models import build_model
from visiondist.models.detection import BUILDERS


def _cfg(**over):
    base = dict(
        name="x",
        family="torchvision",
        arch="fasterrcnn_mobilenet_v3_large_fpn",
        weights=None,
        num_classes=3,
        min_size=64,
        max_size=64,
        kwargs={},
        img_size=64,
        patch_size=16,
        embed_dim=32,
        depth=1,
        num_heads=2,
        mlp_ratio=2.0,
        drop_path_rate=0.0,
        fpn_channels=16,
        sync_bn=False,
    )
    return OmegaConf.create({**base, **over})


# the R-CNNs sample 32 RoIs an image from 100 proposals, not 512 from 2,000: the same code paths
# (each head, each loss, the image without a box), a third of the CPU time
FEW_ROIS = dict(
    box_batch_size_per_image=32, rpn_pre_nms_top_n_train=200, rpn_post_nms_top_n_train=100
)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_every_torchvision_detector_builds_offline_and_trains(arch):
    torch.manual_seed(0)
    model = build_model(_cfg(arch=arch, kwargs=FEW_ROIS if "rcnn" in arch else {}))
    images = [torch.rand(3, 64, 64), torch.rand(3, 48, 64)]
    targets = [
        {"boxes": torch.tensor([[4.0, 4.0, 30.0, 40.0]]), "labels": torch.tensor([3])},
        # an image with no box
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)},
    ]
    if arch.startswith("maskrcnn"):  # a mask per box, at the image's size
        mask = torch.zeros(1, 64, 64, dtype=torch.uint8)
        mask[0, 4:40, 4:30] = 1
        targets[0]["masks"], targets[1]["masks"] = mask, torch.zeros(0, 48, 64, dtype=torch.uint8)
    losses = model(images, targets)
    assert ("loss_mask" in losses) == arch.startswith("maskrcnn")
    total = sum(losses.values())
    assert torch.isfinite(total) and total > 0
    total.backward()
    if hasattr(model, "roi_heads"):  # Faster R-CNN: 3 classes + background
        assert model.roi_heads.box_predictor.cls_score.out_features == 4
    else:  # RetinaNet / FCOS
        assert model.head.classification_head.num_classes == 4


def test_local_weights_load_exactly(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    source = build_model(_cfg(family="vitdet"))
    save_file(
        {k: v.contiguous() for k, v in source.state_dict().items()}, str(tmp_path / "w.safetensors")
    )
    torch.manual_seed(2)
    loaded = build_model(_cfg(family="vitdet", weights=str(tmp_path / "w.safetensors")))
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="no such file"):
        build_model(_cfg(weights=str(tmp_path / "missing.pt")))


def _data_cfg(**over):
    return OmegaConf.create(
        {
            "min_size": 32,
            "max_size": 48,
            "hflip": 0.0,
            "color_jitter": 0.0,
            "large_scale_jitter": False,
            "lsj_scale": [0.5, 1.5],
            **over,
        }
    )


def test_resize_keeps_aspect_and_scales_boxes():
    image = np.zeros((20, 40, 3), np.uint8)
    out, boxes = resize_keep_aspect(image, np.array([[4.0, 2.0, 10.0, 8.0]], np.float32), 32, 48)
    # short side 32 would make the long side 64 > 48: the long side decides
    assert out.shape == (24, 48, 3)
    assert np.allclose(boxes, [[4.8, 2.4, 12.0, 9.6]])


def test_flip_moves_boxes_with_pixels_and_lsj_gives_squares():
    image = np.zeros((32, 32, 3), np.uint8)
    image[8:16, 2:10] = 255  # a white box at x 2..10, y 8..16
    flip = DetectionTransform(_data_cfg(hflip=1.0), seed=0)
    out, boxes, labels = flip(
        image, np.array([[2.0, 8.0, 10.0, 16.0]], np.float32), np.array([1]), 0, 0
    )
    assert np.allclose(boxes, [[22.0, 8.0, 30.0, 16.0]]) and labels.tolist() == [1]
    assert out[12, 22:30].min() == 255 and out[12, 2:10].max() == 0
    lsj = DetectionTransform(_data_cfg(large_scale_jitter=True), seed=0)
    for index in range(8):
        out, boxes, labels = lsj(
            image, np.array([[2.0, 8.0, 10.0, 16.0]], np.float32), np.array([1]), index, 0
        )
        assert out.shape == (32, 32, 3) and len(boxes) == len(labels) <= 1
        assert (boxes >= 0).all() and (boxes <= 32).all()


def test_vit_loads_local_timm_weights(tmp_path):
    import timm
    from safetensors.torch import save_file

    ref = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=32, depth=2
    )
    save_file(ref.state_dict(), str(tmp_path / "timm.safetensors"))
    cfg = _cfg(
        family="vit",
        img_size=32,
        patch_size=16,
        embed_dim=192,
        depth=2,
        num_heads=3,
        mlp_ratio=4.0,
        qkv_bias=True,
        drop_rate=0.0,
        weights=str(tmp_path / "timm.safetensors"),
    )
    ours = build_model(cfg).eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(ours(x), ref.eval()(x), atol=1e-5)


@pytest.mark.parametrize("family", ["torchvision", "vitdet"])
def test_boxes_stay_fp32_under_bf16_autocast(family):
    """torchvision draws anchors in the feature maps' dtype and decodes boxes in the regressions'
    dtype: under bf16 autocast at 800 x 1333 a corner is off by up to 4-8 px. With the box
    regressions zeroed, every box the detector returns is one of its (clipped) anchors, so any
    distance to the fp32 anchors is the box arithmetic's alone, not the bf16 backbone's."""
    torch.manual_seed(0)
    boxes, distance = bf16_box_distances(
        build_model(_cfg(family=family, min_size=800, max_size=1333, img_size=224)), "cpu"
    )
    assert boxes.dtype == torch.float32 and len(boxes) > 20
    assert distance.max() <= 1.0, distance.max()
