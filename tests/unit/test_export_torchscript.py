"""format=torchscript of a torchvision detector: the scripted file resizes every image to the size
the PyTorch model does, so that it finds the same boxes (scripted as torchvision writes it, a
200 x 200 image at min_size 240 came out 239 rows high, and a trained Faster R-CNN's box moved
4 px)."""

import warnings

import torch
import torchvision

from visiondist.checkpoint.export.script_resize import exact_script_resize


def _scripted(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with exact_script_resize():
            return torch.jit.script(model)


def test_a_scripted_detector_resizes_and_detects_as_pytorch_at_every_size():
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=3,
        min_size=240,
        max_size=400,
        box_score_thresh=0.0,
    ).eval()
    scripted = _scripted(model)
    sizes = [(200, 200)] + [(height, 333) for height in range(120, 420, 7)]
    with torch.no_grad():
        for height, width in sizes:
            image = torch.rand(3, height, width)
            want = model.transform.resize(image, None)[0].shape
            assert scripted.transform.resize(image, None)[0].shape == want, (height, width)
        for height, width in sizes[:3]:
            image = torch.rand(3, height, width)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (losses, detections), said each call
                got = scripted([image])[1][0]
            want = model([image])[0]
            assert len(want["boxes"]) > 0 and torch.equal(got["boxes"], want["boxes"])
    # training's call (with targets) is torchvision's own
    model.train()
    target = {"boxes": torch.tensor([[10.0, 10.0, 60.0, 80.0]]), "labels": torch.tensor([1])}
    losses = _scripted(model)([torch.rand(3, 200, 200)], [target])[0]
    assert set(losses) >= {"loss_classifier", "loss_box_reg"}
