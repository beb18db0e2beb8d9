"""Exported files run where a prediction or an evaluation takes weights: the loaded file answers as
the PyTorch model does (a detector's batch of images of any sizes, a classifier's logits), and a
file that does not fit the model config is refused in one line naming the fix."""

import json
from pathlib import Path

import pytest
import torch
from helpers import REPO, TINY_DATA, assert_same_detections, tiny_vitdet

from visiondist.cli import load_config
from visiondist.config import ConfigError

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")


def _vit(tmp_path: Path):
    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.trained import Trained
    from visiondist.models import build_model

    cfg = load_config(
        REPO / "configs", ["model.depth=1", "model.num_heads=2", "data.img_size=32"], inputs=None
    )
    torch.manual_seed(0)
    trained = Trained(cfg, build_model(cfg.model).eval(), tmp_path / "step_1", 1, None)
    path = tmp_path / "vit.onnx"
    export(trained, "onnx", path)
    return trained, path


def test_a_classifier_graph_gives_the_models_logits_and_is_refused_where_it_does_not_fit(
    tmp_path,
):
    from visiondist.checkpoint.export.runtimes import load_runtime
    from visiondist.models.exported import check_runtime_file, graph_task

    trained, path = _vit(tmp_path)
    assert graph_task(path) == ("classification", {"side": 32, "classes": 6})
    model = load_runtime(trained.cfg.model, path, torch.device("cpu"))
    assert model.runtime == "ONNX Runtime" and not model.training
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), trained.model(x), atol=1e-4, rtol=0)
    with pytest.raises(RuntimeError, match="evaluates and predicts only"):
        model.train()

    other = load_config(
        REPO / "configs", ["model.depth=1", "data.img_size=64", "data.num_classes=6"], inputs=None
    )
    with pytest.raises(ConfigError, match=r"takes 32 px images but model.img_size=64: set "):
        check_runtime_file(other.model, path)
    other = load_config(REPO / "configs", ["data.img_size=32", "data.num_classes=10"], inputs=None)
    with pytest.raises(ConfigError, match=r"gives 6 logits but .*: set data.num_classes=6$"):
        check_runtime_file(other.model, path)
    detector = load_config(REPO / "configs", ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco"])
    with pytest.raises(
        ConfigError,
        match=r"is a classification graph but model=fasterrcnn_mobilenet_v3 is a detection "
        r"model: give the model it was exported from",
    ):
        check_runtime_file(detector.model, path)


def test_a_detector_graph_answers_a_batch_as_pytorch_answers_each_image(tmp_path):
    """ViTDet's graph (masks too) through the runtime model: images of five sizes in one call,
    each one's detections what PyTorch returns for it alone; the older one-image graph is named and
    refused."""
    import onnx
    from onnx import TensorProto, helper

    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.runtimes import load_runtime
    from visiondist.models.exported import check_runtime_file, graph_task

    trained = tiny_vitdet(tmp_path, masks=True)
    path = tmp_path / "vitdet.onnx"
    export(trained, "onnx", path)
    assert graph_task(path) == ("detection", {"input": {"images": "canvas"}})
    model = load_runtime(trained.cfg.model, path, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    sizes = [(64, 64), (64, 32), (40, 64), (82, 25), (100, 100)]
    images = [torch.rand(3, h, w, generator=generator) for h, w in sizes]
    got = model(images)
    for image, found in zip(images, got):
        with torch.no_grad():
            want = trained.model([image])[0]
        assert found["masks"].shape[1:] == (1, *image.shape[-2:])
        assert len(found["boxes"]) == len(want["boxes"]) > 0
        pairs = assert_same_detections(want, {k: v.numpy() for k, v in found.items()}, 1e-2, 1e-4)
        for i, j in pairs:
            torch.testing.assert_close(found["masks"][j], want["masks"][i], atol=1e-3, rtol=0)

    old = tmp_path / "old.onnx"
    graph = helper.make_graph(
        [helper.make_node("Identity", ["image"], ["boxes"])],
        "old",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [3, "h", "w"])],
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [3, "h", "w"])],
    )
    onnx.save(helper.make_model(graph), str(old))
    with pytest.raises(
        ConfigError, match=r"is a one-image detector graph .*: export the run again"
    ):
        check_runtime_file(trained.cfg.model, old)
    assert json.loads(model.session.get_modelmeta().custom_metadata_map["input"]) == {
        "images": "canvas"
    }


@pytest.mark.parametrize("masks", [False, True], ids=["boxes", "masks"])
def test_the_deploy_docs_code_runs_on_an_exported_detector(tmp_path, monkeypatch, masks):
    """docs/deploy.md's Python block, as written, on a ViTDet export (the canvas form): it runs,
    and its boxes for each photo are what the runtime model (tools/predict.py's) gives; a mask
    model's masks, cut to the image and thresholded as the block does, are its masks at 0.5."""
    import re

    import numpy as np

    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.runtimes import load_runtime

    trained = tiny_vitdet(tmp_path, masks=masks)
    export(trained, "onnx", tmp_path / "model.onnx")
    text = (REPO / "docs" / "deploy.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)[1]
    monkeypatch.chdir(tmp_path)
    # the file names no labels where the run recorded no category ids: one for the block's lookup
    import onnx

    proto = onnx.load("model.onnx")
    labels = {str(k): {"category_id": k, "name": f"c{k}"} for k in range(1, 7)}
    proto.metadata_props.add(key="labels", value=json.dumps(labels))
    onnx.save(proto, "model.onnx")
    scope: dict = {}
    exec(compile(code, "docs/deploy.md", "exec"), scope)
    assert "torch" not in scope  # the canvas form: numpy and onnxruntime alone
    model = load_runtime(trained.cfg.model, tmp_path / "model.onnx", torch.device("cpu"))
    for i, photo in enumerate(scope["photos"]):
        want = model([torch.from_numpy(photo)])[0]
        n = int(scope["count"][i])
        assert n == len(want["boxes"]) > 0
        np.testing.assert_allclose(scope["boxes"][i, :n], want["boxes"].numpy(), atol=1e-4)
    assert len(scope["ids"]) == int(scope["count"][-1])
    if masks:  # the block's last image's masks
        binary = want["masks"][:, 0].numpy() >= 0.5
        assert scope["binary"].shape == binary.shape == (n, *scope["photos"][-1].shape[1:])
        assert (scope["binary"] != binary).mean() < 1e-3  # a pixel at 0.5 may round either way
    else:
        assert scope["masks"] is None


def test_a_half_graph_keeps_float32_edges_and_answers_within_float16s_precision(tmp_path):
    """half=True: the ViT's weights float16 in the file (about half its size), its inputs and
    outputs float32, its logits within float16's precision of PyTorch's; ViTDet's backbone and
    heads float16, its boxes, in float32, those of PyTorch within a pixel; the run's model itself
    untouched by the export (float32, the same outputs after it)."""
    import onnx
    from onnx import TensorProto

    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.onnx_check import check_onnx
    from visiondist.checkpoint.export.runtimes import load_runtime

    trained, full = _vit(tmp_path)
    half = tmp_path / "vit_fp16.onnx"
    export(trained, "onnx", half, half=True)
    proto = onnx.load(str(half))
    kinds = {t.data_type for t in proto.graph.initializer if len(t.dims) >= 2}
    assert kinds == {TensorProto.FLOAT16}, kinds
    assert [i.type.tensor_type.elem_type for i in proto.graph.input] == [TensorProto.FLOAT]
    assert [o.type.tensor_type.elem_type for o in proto.graph.output] == [TensorProto.FLOAT]
    assert half.stat().st_size < 0.6 * full.stat().st_size
    check = check_onnx(trained, half)
    assert check.precision == "float16" and 0 < check.max_diff < 1e-2, check.summary()
    assert check.summary().startswith("ONNX Runtime (float16 network) vs PyTorch (float32):")
    x = torch.randn(2, 3, 32, 32)
    model = load_runtime(trained.cfg.model, half, torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(model(x), trained.model(x), atol=1e-2, rtol=0)
    assert all(p.dtype == torch.float32 for p in trained.model.parameters())

    detector = tiny_vitdet(tmp_path, masks=False)
    image = torch.rand(3, 64, 48, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = detector.model([image])[0]
    path = tmp_path / "vitdet_fp16.onnx"
    export(detector, "onnx", path, half=True)
    with torch.no_grad():
        after = detector.model([image])[0]
    assert torch.equal(before["boxes"], after["boxes"])  # the run's model is as it was
    found = load_runtime(detector.cfg.model, path, torch.device("cpu"))([image])[0]
    assert found["boxes"].dtype == torch.float32 and len(found["boxes"]) > 0
    top = before["scores"].argmax()
    near = (found["boxes"] - before["boxes"][top]).abs().amax(-1).min()
    assert float(near) < 1.0, float(near)


def test_an_int8_graph_is_calibrated_on_the_runs_train_images_or_refused_without_them(
    tmp_path, tiny_shapes, shapes_coco
):
    """int8=True: a ViT's and a ViTDet's matrix products and convolutions quantized (QDQ nodes),
    calibrated on the runs' train images (named in the metadata), answering near PyTorch; where the
    train split is not on the machine, a ValueError naming the fix, and no file."""
    import onnx

    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.onnx_check import check_onnx
    from visiondist.checkpoint.export.runtimes import load_runtime
    from visiondist.checkpoint.export.trained import Trained
    from visiondist.models import build_model

    cfg = load_config(
        REPO / "configs",
        [*TINY_DATA, f"data.root={tiny_shapes}", "model.num_heads=2", "model.depth=1"],
        inputs=None,
    )
    torch.manual_seed(0)
    trained = Trained(cfg, build_model(cfg.model).eval(), tmp_path / "step_1", 1, None)
    path = tmp_path / "vit_int8.onnx"
    export(trained, "onnx", path, int8=True)
    proto = onnx.load(str(path))
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["precision"] == "int8" and meta["calibrated_on"] == "32 train images", meta
    ops = {node.op_type for node in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "MatMul"} <= ops
    check = check_onnx(trained, path)
    assert check.precision == "int8" and check.max_diff < 0.5, check.summary()
    model = load_runtime(cfg.model, path, torch.device("cpu"))
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x).argmax(1), trained.model(x).argmax(1))

    detector = tiny_vitdet(tmp_path, masks=False)
    with pytest.raises(ValueError, match=r"int8=true calibrates on the run's train images, which"):
        export(detector, "onnx", tmp_path / "none.onnx", int8=True)
    assert not list(tmp_path.glob("none.onnx*"))
    detector.cfg.data.root = str(shapes_coco)
    path = tmp_path / "vitdet_int8.onnx"
    export(detector, "onnx", path, int8=True)
    assert {"QuantizeLinear", "Loop"} <= {n.op_type for n in onnx.load(str(path)).graph.node} | {
        n.op_type for n in onnx.load(str(path)).graph.node[-1].attribute[0].g.node
    }
    image = torch.rand(3, 64, 48, generator=torch.Generator().manual_seed(5))
    found = load_runtime(detector.cfg.model, path, torch.device("cpu"))([image])[0]
    assert len(found["boxes"]) > 0 and found["boxes"].dtype == torch.float32
