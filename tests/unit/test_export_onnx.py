"""ONNX export of detectors at any image size: the traced resize takes the eager model's output size
for every input size (torchvision's own trace is a pixel short for some), and ViTDet's graph, traced
at its position embedding's grid, matches PyTorch on images that need another grid, masks
included."""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, assert_same_detections, sample_photos, tiny_vitdet
from torch import nn
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from visiondist.cli import load_config

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


class _Resized(nn.Module):
    """A detector's input transform alone: one image in, the resized image's (height, width) out."""

    def __init__(self):
        super().__init__()
        self.transform = GeneralizedRCNNTransform(800, 1333, [0.0] * 3, [1.0] * 3)

    def forward(self, images: list[torch.Tensor]) -> torch.Tensor:
        return torch._shape_as_tensor(self.transform.resize(images[0], None)[0])[-2:]


def _sizes_in_onnx(path: Path, heights: list[int], width: int) -> list[tuple[int, int]]:
    session = ort.InferenceSession(str(path))
    return [
        tuple(session.run(None, {"image": np.zeros((3, h, width), np.float32)})[0]) for h in heights
    ]


# torchvision's private resize is swapped for the trace: on every supported torchvision
@pytest.mark.smoke
def test_the_traced_resize_takes_the_eager_output_size_for_every_input_size(tmp_path):
    from visiondist.checkpoint.export.onnx_resize import exact_resize

    # short side 200..1097, then long
    model, heights, width = _Resized().eval(), list(range(200, 1200, 3)), 1100
    eager = [tuple(model([torch.zeros(3, h, width)]).tolist()) for h in heights]

    def export(path: Path) -> Path:
        with torch.no_grad():
            torch.onnx.export(
                model,
                ([torch.zeros(3, 480, 640)],),
                str(path),
                dynamo=False,
                opset_version=17,
                input_names=["image"],
                dynamic_axes={"image": {1: "height", 2: "width"}},
            )
        return path

    with exact_resize():
        exact = _sizes_in_onnx(export(tmp_path / "exact.onnx"), heights, width)
    assert exact == eager
    # the context is gone again
    plain = _sizes_in_onnx(export(tmp_path / "plain.onnx"), heights, width)
    short = [h for h, got, want in zip(heights, plain, eager) if got != want]
    assert len(short) > 10, "torchvision's own trace was expected to miss some sizes by a pixel"


def test_vitdet_exports_to_onnx_and_matches_pytorch_at_other_sizes(tmp_path):
    """Traced on a 64-px example, at the grid its position embedding was learned for (an eager
    shortcut skips the interpolation there, which a trace must keep); images padded to another
    aspect need other grids (64 x 32: 4 x 2 patches), and 82 x 25 a resize down that torchvision's
    own trace makes a pixel short (63 rows, not 64). The five sizes go through the graph in one
    batch (each on the canvas of the largest), then one alone: every image's detections and masks
    are what PyTorch returns for it alone, the padding after them zero."""
    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.onnx_batch import canvas
    from visiondist.checkpoint.export.onnx_check import check_onnx

    trained = tiny_vitdet(tmp_path, masks=True)
    path = tmp_path / "vitdet.onnx"
    export(trained, "onnx", path)
    check = check_onnx(trained, path)
    assert check.boxes > 0 and check.max_diff < 1e-3 and check.masks > 0 and not check.failed, (
        check.summary()
    )

    session = ort.InferenceSession(str(path))
    k = trained.model.roi_heads.detections_per_img
    # the graph declares K (a serving config or a runtime allocating its output buffers reads it)
    declared = {o.name: o.shape for o in session.get_outputs()}
    assert declared["boxes"][1:] == [k, 4] and declared["masks"][1:3] == [k, 1], declared
    generator = torch.Generator().manual_seed(1)
    sizes = [(64, 64), (64, 32), (40, 64), (82, 25), (100, 100)]
    images = [torch.rand(3, height, width, generator=generator) for height, width in sizes]
    for batch in (images, images[3:4]):
        feed, hw = canvas(batch)
        boxes, labels, scores, count, masks = session.run(
            None, {"images": feed.numpy(), "sizes": hw.numpy()}
        )
        assert boxes.shape == (len(batch), k, 4) and masks.shape[:3] == (len(batch), k, 1)
        assert masks.shape[-2:] == feed.shape[-2:]
        for i, image in enumerate(batch):
            height, width = image.shape[-2:]
            with torch.no_grad():
                want = trained.model([image])[0]
            n = int(count[i])
            assert n == len(want["boxes"])
            assert not boxes[i, n:].any() and not labels[i, n:].any() and not masks[i, n:].any()
            assert not masks[i, :, :, height:].any() and not masks[i, :, :, :, width:].any()
            # an untrained detector's scores tie to round-off: matched as sets, the detections at
            # the last kept score aside
            pairs = assert_same_detections(
                want,
                dict(boxes=boxes[i, :n], labels=labels[i, :n], scores=scores[i, :n]),
                1e-2,
                1e-4,
            )
            assert len(pairs) > n // 2, (height, width)
            for a, j in pairs:
                np.testing.assert_allclose(
                    masks[i, j, :, :height, :width],
                    want["masks"][a].numpy(),
                    atol=1e-3,
                    err_msg=str((height, width)),
                )


def test_vitdet_takes_a_batch_of_photos_of_four_sizes_as_pytorch_takes_each(tmp_path):
    """Four real photographs of four sizes through ViTDet's graph (torchvision's two-stage heads
    on the ViT) in one batch: each one's detections are PyTorch's for it alone, every one to
    round-off (heads He-initialised, so that scores spread as a trained model's do)."""

    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.onnx_batch import canvas
    from visiondist.checkpoint.export.onnx_check import _box_diff

    trained = tiny_vitdet(tmp_path, masks=False)
    with torch.no_grad():
        for key, param in trained.model.named_parameters():
            if param.dim() > 1 and ("roi_heads" in key or "rpn" in key):
                param.normal_(std=(2.0 / param[0].numel()) ** 0.5)
    path = tmp_path / "vitdet.onnx"
    export(trained, "onnx", path)
    photos = sample_photos("coffee", "chelsea", "astronaut", "rocket")
    assert len({tuple(p.shape) for p in photos}) == 4
    images, sizes = canvas(photos)
    boxes, labels, scores, count = ort.InferenceSession(str(path)).run(
        None, {"images": images.numpy(), "sizes": sizes.numpy()}
    )
    for i, photo in enumerate(photos):
        with torch.no_grad():
            want = trained.model([photo])[0]
        n = int(count[i])
        assert n == len(want["boxes"]) > 0
        got = [boxes[i, :n], labels[i, :n], scores[i, :n]]
        # px of the photo: the model sees it at 64 px, so its round-off is scaled by up to 8
        assert _box_diff([want["boxes"], want["labels"], want["scores"]], got) < 0.05


def test_vitdet_torchscript_and_pt2_are_refused_naming_onnx(tmp_path):
    from visiondist.checkpoint.export import export

    vitdet = tiny_vitdet(tmp_path, masks=False)
    with pytest.raises(ValueError, match="format=onnx"):
        export(vitdet, "torchscript", tmp_path / "vitdet.pt")
    with pytest.raises(
        ValueError,
        match=r"format=pt2 exports classifiers: .* export format=onnx \(any image size\)$",
    ):
        export(vitdet, "pt2", tmp_path / "vitdet.pt2")
    assert not list(tmp_path.glob("vitdet*"))


def test_a_torchvision_detector_takes_a_batch_of_photos_of_four_sizes(tmp_path):
    """A one-stage torchvision detector (FCOS, fresh; every box kept; its thresholds per level):
    four real photographs of four sizes through the exported graph in one batch give, for each, the
    detections PyTorch gives for it alone, every one to round-off, and the export's own check says
    so. (The two-stage heads: ViTDet's test above, and the trained Faster R-CNN of
    tests/multirank/test_detection_train.py.)"""

    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.onnx_batch import canvas
    from visiondist.checkpoint.export.onnx_check import _box_diff, check_onnx
    from visiondist.checkpoint.export.trained import Trained
    from visiondist.models import build_model

    cfg = load_config(
        REPO / "configs",
        [
            "model=fcos_r50",
            "data=shapes_coco",
            f"data.root={tmp_path / 'absent'}",
            "data.min_size=96",
            "data.max_size=160",
            "+model.kwargs.score_thresh=0.0",
        ],
        inputs=None,
    )
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    # scores spread as a trained detector's are (a fresh one's tie to round-off, and which of them
    # top-k keeps is then the arithmetic's choice): He-initialised heads, spread class biases
    with torch.no_grad():
        for key, param in model.named_parameters():
            if param.dim() > 1 and "head" in key:
                param.normal_(std=(2.0 / param[0].numel()) ** 0.5)
            elif "cls" in key or ("bias" in key and "head" in key):
                param.normal_(std=0.5)
    trained = Trained(cfg, model, tmp_path / "step_1", 1, None)
    path = tmp_path / "detector.onnx"
    export(trained, "onnx", path)
    check = check_onnx(trained, path)
    assert check.boxes > 0 and check.onnx_boxes == check.boxes and not check.failed, check.summary()

    photos = sample_photos("coffee", "chelsea", "astronaut", "rocket")
    assert len({tuple(p.shape) for p in photos}) == 4
    images, sizes = canvas(photos)
    session = ort.InferenceSession(str(path))
    assert session.get_modelmeta().custom_metadata_map["precision"] == "float32"
    boxes, labels, scores, count = session.run(
        None, {"images": images.numpy(), "sizes": sizes.numpy()}
    )
    for i, photo in enumerate(photos):
        with torch.no_grad():
            want = trained.model([photo])[0]
        n = int(count[i])
        assert n == len(want["boxes"]) > 0
        assert not boxes[i, n:].any() and not scores[i, n:].any() and not labels[i, n:].any()
        got = [boxes[i, :n], labels[i, :n], scores[i, :n]]
        assert _box_diff([want["boxes"], want["labels"], want["scores"]], got) < 1e-3


def test_a_faster_rcnn_whose_rpn_proposes_nothing_on_an_image_returns_no_detections_there(
    tmp_path,
):
    """torchvision's MobileNet Faster R-CNN keeps proposals scoring 0.05 or more; an image where
    none does gets no detections from PyTorch. The exported graph gives it none too, in a batch
    beside a photo that has some (torchvision's own trace fails there: `Input shape:{0,28},
    requested shape:{0,-1}`, on 7% of the val images of a model trained for 226 steps)."""
    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.onnx_batch import canvas
    from visiondist.checkpoint.export.onnx_check import _box_diff, _proposals, check_onnx
    from visiondist.checkpoint.export.trained import Trained
    from visiondist.models import build_model

    cfg = load_config(
        REPO / "configs",
        [
            "model=fasterrcnn_mobilenet_v3",
            "data=shapes_coco",
            f"data.root={tmp_path / 'absent'}",
            "data.min_size=96",
            "data.max_size=160",
        ],
        inputs=None,
    )
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():  # features and scores that spread, as a trained model's do
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(std=(2.0 / param[0].numel()) ** 0.5)
    photos = sample_photos("coffee", "chelsea")

    def best_proposal(photo: torch.Tensor) -> float:
        """The score of the RPN's best proposal on `photo` (to 1e-6: the threshold that keeps
        one)."""
        low, high = 0.0, 1.0
        for _ in range(20):
            model.rpn.score_thresh = (low + high) / 2
            low, high = (
                (model.rpn.score_thresh, high)
                if _proposals(model, photo)
                else (low, model.rpn.score_thresh)
            )
        return low

    def best_logit(photo: torch.Tensor) -> float:
        with torch.no_grad():
            images, _ = model.transform([photo])
            logits, _ = model.rpn.head(list(model.backbone(images.tensors).values()))
        return max(float(level.abs().max()) for level in logits)

    # objectness logits of at most 2 (probabilities that differ), then a threshold between the two
    # photos' best proposals: one keeps some, the other none
    cls = model.rpn.head.cls_logits
    with torch.no_grad():
        scale = 2.0 / max(best_logit(p) for p in photos)
        cls.weight.mul_(scale), cls.bias.mul_(scale)
    low, high = sorted(best_proposal(p) for p in photos)
    assert high - low > 1e-5
    model.rpn.score_thresh = low + 1e-5  # just above: the other photo keeps the most
    # every proposal's boxes kept, as they are (a fresh box regression can make them empty)
    model.roi_heads.score_thresh = 0.0
    with torch.no_grad():
        model.roi_heads.box_predictor.bbox_pred.weight.zero_()
        model.roi_heads.box_predictor.bbox_pred.bias.zero_()
    with torch.no_grad():
        want = model(photos)
    empty = [len(w["boxes"]) for w in want].index(0)
    assert len(want[1 - empty]["boxes"]) > 0
    trained = Trained(cfg, model, tmp_path / "step_1", 1, None)
    path = tmp_path / "detector.onnx"
    export(trained, "onnx", path)
    images, sizes = canvas(photos)
    boxes, labels, scores, count = ort.InferenceSession(str(path)).run(
        None, {"images": images.numpy(), "sizes": sizes.numpy()}
    )
    assert int(count[empty]) == 0 and not boxes[empty].any() and not scores[empty].any()
    n = int(count[1 - empty])
    assert n == len(want[1 - empty]["boxes"])
    got = [boxes[1 - empty, :n], labels[1 - empty, :n], scores[1 - empty, :n]]
    w = want[1 - empty]
    # px of a 451 x 300 photo seen at 96 px by a He-initialised network, whose activations grow
    # layer by layer, and with them float32's round-off
    assert _box_diff([w["boxes"], w["labels"], w["scores"]], got) < 0.1
    assert not check_onnx(trained, path).failed

    # OpenVINO's run of the same graph makes up a row (label 0, score 0) for the empty image: the
    # session leaves it out
    pytest.importorskip("openvino")
    from visiondist.checkpoint.export.openvino import OpenVinoSession

    export(trained, "openvino", tmp_path / "openvino" / "model.xml")
    session = OpenVinoSession(tmp_path / "openvino" / "model.xml")
    boxes, labels, scores, count = session.run(
        None, {"images": images.numpy(), "sizes": sizes.numpy()}
    )
    assert int(count[empty]) == 0 and not boxes[empty].any() and not scores[empty].any()
    assert int(count[1 - empty]) == n and (labels[1 - empty, :n] > 0).all()
