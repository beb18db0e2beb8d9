"""ONNX export of detectors at any image size: the traced resize takes the eager model's output size
for every input size (torchvision's own trace is a pixel short for some), and ViTDet's graph, traced
at its position embedding's grid, matches PyTorch on images that need another grid, masks
included."""

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, assert_same_detections
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


def _vitdet(tmp_path: Path, masks: bool):
    from visiondist.checkpoint.export.trained import Trained
    from visiondist.models import build_model
    from visiondist.models.detection import drop_fp32_hooks

    cfg = load_config(
        REPO / "configs",
        [
            "model=vitdet_tiny",
            "data=shapes_coco",
            f"data.root={tmp_path / 'absent'}",
            "data.img_size=64",
            "data.min_size=64",
            "data.max_size=64",
            "model.depth=1",
            "model.embed_dim=32",
            "model.num_heads=2",
            "model.fpn_channels=16",
            f"model.masks={str(masks).lower()}",
            "+model.kwargs.box_score_thresh=0.0",
        ],
        inputs=None,
    )
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    drop_fp32_hooks(model)
    return Trained(
        cfg, model, tmp_path / "step_1", 1, [f"c{i}" for i in range(cfg.model.num_classes)]
    )


def test_vitdet_exports_to_onnx_and_matches_pytorch_at_other_sizes(tmp_path):
    """Traced on a 64-px example, at the grid its position embedding was learned for (an eager
    shortcut skips the interpolation there, which a trace must keep); images padded to another
    aspect need other grids (64 x 32: 4 x 2 patches), and 82 x 25 a resize down that torchvision's
    own trace makes a pixel short (63 rows, not 64)."""
    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.onnx_check import check_onnx

    trained = _vitdet(tmp_path, masks=True)
    path = tmp_path / "vitdet.onnx"
    export(trained, "onnx", path)
    check = check_onnx(trained, path)
    assert check.boxes > 0 and check.max_diff < 1e-3 and check.masks > 0 and not check.failed, (
        check.summary()
    )

    session = ort.InferenceSession(str(path))
    generator = torch.Generator().manual_seed(1)
    for height, width in [(64, 64), (64, 32), (40, 64), (82, 25), (100, 100)]:
        image = torch.rand(3, height, width, generator=generator)
        with torch.no_grad():
            want = trained.model([image])[0]
        boxes, labels, scores, masks = session.run(None, {"image": image.numpy()})
        # an untrained detector's scores tie to round-off: matched as sets, the detections at the
        # last kept score aside
        pairs = assert_same_detections(
            want, dict(boxes=boxes, labels=labels, scores=scores), 1e-2, 1e-4
        )
        assert len(pairs) > len(want["boxes"]) // 2 and masks.shape[-2:] == (height, width), (
            height,
            width,
        )
        for i, j in pairs:
            np.testing.assert_allclose(
                masks[j], want["masks"][i].numpy(), atol=1e-3, err_msg=str((height, width))
            )


def test_vitdet_torchscript_and_pt2_are_refused_naming_onnx(tmp_path):
    from visiondist.checkpoint.export import export

    vitdet = _vitdet(tmp_path, masks=False)
    with pytest.raises(ValueError, match="format=onnx"):
        export(vitdet, "torchscript", tmp_path / "vitdet.pt")
    with pytest.raises(
        ValueError,
        match=r"format=pt2 exports classifiers: .* export format=onnx \(any image size\)$",
    ):
        export(vitdet, "pt2", tmp_path / "vitdet.pt2")
    assert not list(tmp_path.glob("vitdet*"))
