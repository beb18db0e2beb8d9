"""format=onnx: the eval-mode model as an ONNX graph (classifier: images -> logits with a dynamic
batch, dynamo exporter; torchvision detector or ViTDet: one image of any size -> boxes, labels,
scores (and masks), TorchScript-based exporter, with the eager model's resize: `onnx_resize.py`)
with the names of what it predicts in the graph's metadata. `onnx_check.py` runs the file under ONNX
Runtime against PyTorch.

Metadata keys (`onnx.load(path).metadata_props`, `onnxruntime.InferenceSession(path).get_modelmeta()
.custom_metadata_map`): `classes` (a classifier: JSON list, logit i is class i), `labels` (a
detector: JSON object, label k -> {"category_id": COCO category id, "name"}; 0 is the background),
`score_thresh` (a detector: the Constant nodes holding its score thresholds, for
`set_score_thresholds`).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from visiondist.checkpoint.export.onnx_resize import exact_resize
from visiondist.checkpoint.export.preprocessing import name_metadata
from visiondist.checkpoint.export.trained import Trained, example_images
from visiondist.models.detection import has_mask_head
from visiondist.models.detr import DetrDetector, DetrForExport

log = logging.getLogger(__name__)


def write_onnx(trained: Trained, path: Path, out: Path) -> list[Path]:
    """The ONNX file of `trained`'s model at `path` (a temporary name of `out`), the names of its
    outputs in its metadata_props (key -> JSON text); nothing else.

    Args:
        trained: the run's model and what it records (`load_trained`).
        path: where to write (a temporary name of `out`, renamed by `export`).
        out: the export's final path.

    Returns:
        No other file ([]).
    """
    metadata = name_metadata(trained)
    model, family = trained.model, trained.cfg.model.family
    if family == "vit":
        batch = torch.export.Dim("batch", min=1, max=4096)
        # torch.onnx's progress lines and its internals' deprecation notes (torch 2.11: LeafSpec,
        # from a copy of the exported program) are left out: the tool prints the file written, and
        # check_onnx tests the graph
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                model,
                (example_images(trained.cfg),),
                dynamo=True,
                input_names=["images"],
                output_names=["logits"],
                dynamic_shapes={"x": {0: batch}},
                external_data=False,
                verbose=False,
            )
        assert program is not None  # dynamo=True returns the program
        program.model.metadata_props.update(metadata)
        program.save(str(path))
    elif family in ("torchvision", "vitdet"):
        _export_detector_onnx(model, example_images(trained.cfg, 1)[0], path, metadata)
    elif family == "detr":
        assert isinstance(model, DetrDetector)  # what model.family=detr builds
        _export_detr_onnx(model, path, metadata)
    else:
        raise ValueError(
            f"format=onnx is not supported for model.family={family}: export format=safetensors"
        )
    return []


def _export_detr_onnx(model: DetrDetector, path: Path, metadata: dict[str, str]) -> None:
    """A DETR-class detector (`DetrForExport`: one image of any size -> boxes, labels, scores of
    every query) with torch.export and a dynamic height and width. The library's shape assertions
    are switched off while it is traced (its own switch, TRANSFORMERS_DISABLE_TORCH_CHECK): ONNX has
    no operator for them."""
    height, width = (
        torch.export.Dim("height", min=32, max=8192),
        torch.export.Dim("width", min=32, max=8192),
    )
    example = torch.rand(3, 480, 640, generator=torch.Generator().manual_seed(0))
    before = os.environ.get("TRANSFORMERS_DISABLE_TORCH_CHECK")
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                DetrForExport(model).eval(),
                (example,),
                dynamo=True,
                input_names=["image"],
                output_names=["boxes", "labels", "scores"],
                external_data=False,
                dynamic_shapes={"image": {1: height, 2: width}},
                verbose=False,
            )
    finally:
        if before is None:
            os.environ.pop("TRANSFORMERS_DISABLE_TORCH_CHECK", None)
        else:
            os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = before
    assert program is not None  # dynamo=True returns the program
    program.model.metadata_props.update(metadata)
    program.save(str(path))


# Score thresholds a torchvision detector's graph is traced with, replaced by the model's own
# afterwards: below 0, so that the trace sees proposals and detections whatever the example image (a
# graph traced where the RPN proposes nothing keeps that branch and fails on every image with
# boxes), and unlike any other constant of the graph.
_TRACE_THRESH = {"rpn": -0.123456, "box": -0.234567}
# the ONNX metadata key: {role: {"nodes": [Constant nodes], "value": threshold}}
THRESH_METADATA = "score_thresh"


def score_thresholds(model: nn.Module) -> dict[str, Any]:
    """The modules holding a torchvision detector's `score_thresh`, by role: "rpn" (Faster R-CNN's
    proposals) and "box" (the detections: Faster R-CNN's roi_heads, RetinaNet / FCOS themselves).
    Typed `Any`: their `score_thresh` is a plain float attribute, which `nn.Module`'s typing of
    attributes (tensors and modules) does not cover."""
    owners = {"rpn": model.rpn} if hasattr(model, "rpn") else {}
    owners["box"] = model.roi_heads if hasattr(model, "roi_heads") else model
    return owners


class thresholds_set:
    """Context: every `score_thresh` of the detector set to values[role], restored on exit."""

    def __init__(self, model: nn.Module, values: dict[str, float]):
        self.owners, self.values = score_thresholds(model), values

    def __enter__(self):
        self.saved = {role: owner.score_thresh for role, owner in self.owners.items()}
        for role, owner in self.owners.items():
            owner.score_thresh = self.values[role]

    def __exit__(self, *exc):
        for role, owner in self.owners.items():
            owner.score_thresh = self.saved[role]


def _export_detector_onnx(
    model: nn.Module, example: torch.Tensor, path: Path, metadata: dict[str, str]
) -> None:
    """torchvision's detectors (ViTDet is one, on its own backbone) through the TorchScript-based
    exporter (opset 17), one image per call (a Mask R-CNN also returns "masks", (detections, 1,
    height, width) probabilities at the image's size), resized to the sizes the eager model takes
    (`exact_resize`). Traced with score thresholds that every box passes, then the graph's threshold
    constants are set to the model's and named in its metadata (`THRESH_METADATA`, beside
    `metadata`); without the onnx package, traced with the model's own thresholds and no
    metadata."""

    outputs = ["boxes", "labels", "scores", *(["masks"] if has_mask_head(model) else [])]
    axes = {"image": {1: "height", 2: "width"}, **{name: {0: "detections"} for name in outputs}}
    if "masks" in outputs:
        axes["masks"] = {0: "detections", 2: "height", 3: "width"}

    def trace(target: Path) -> None:
        # the tracer's notes: check_onnx tests the graph
        with exact_resize(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model,
                ([example],),
                str(target),
                dynamo=False,
                opset_version=17,
                input_names=["image"],
                output_names=outputs,
                dynamic_axes=axes,
            )

    try:
        import onnx  # noqa: PLC0415 (onnx: the export extra)
    except ImportError:
        log.warning(
            "onnx is not installed: the detector is traced with its own score thresholds (if the "
            "example image gets no proposal, the graph fails on images with boxes) and the file "
            "carries no %s: pip install onnx",
            ", ".join(metadata) or "metadata",
        )
        trace(path)
        return
    wanted = {role: float(owner.score_thresh) for role, owner in score_thresholds(model).items()}
    with thresholds_set(model, {role: _TRACE_THRESH[role] for role in wanted}):
        trace(path)
    proto = onnx.load(str(path))
    # RetinaNet, FCOS: per level
    found = {role: _constants_equal(proto, _TRACE_THRESH[role]) for role in wanted}
    if not all(found.values()):  # another torchvision: the plain trace
        log.warning(
            "the score thresholds were not found in the traced graph: traced with the model's own"
        )
        trace(path)
        proto = onnx.load(str(path))
    else:
        meta: dict[str, dict[str, Any]] = {
            role: {"nodes": [node.name for node in nodes], "value": wanted[role]}
            for role, nodes in found.items()
        }
        set_score_thresholds(proto, {role: m["value"] for role, m in meta.items()}, meta)
        proto.metadata_props.add(key=THRESH_METADATA, value=json.dumps(meta))
    for key, value in metadata.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(path))


def _constants_equal(proto, value: float) -> list:
    """The graph's Constant nodes holding the one float32 `value`."""
    from onnx import numpy_helper  # noqa: PLC0415 (onnx: the export extra)

    out = []
    for node in proto.graph.node:
        if node.op_type != "Constant":
            continue
        for attr in node.attribute:
            if attr.name == "value":
                array = numpy_helper.to_array(attr.t)
                if (
                    array.size == 1
                    and array.dtype == np.float32
                    and array.item() == np.float32(value).item()
                ):
                    out.append(node)
    return out


def set_score_thresholds(proto, values: dict[str, float], meta: Optional[dict] = None) -> None:
    """Set the score thresholds of a detector graph exported here (an `onnx.ModelProto`, changed in
    place): values by role ("rpn", "box"), the nodes from its metadata (or `meta`)."""
    from onnx import numpy_helper  # noqa: PLC0415 (onnx: the export extra)

    if meta is None:
        meta = json.loads({p.key: p.value for p in proto.metadata_props}[THRESH_METADATA])
    nodes = {node.name: node for node in proto.graph.node}
    for role, value in values.items():
        for name in meta[role]["nodes"]:
            for attr in nodes[name].attribute:
                if attr.name == "value":
                    attr.t.CopyFrom(
                        numpy_helper.from_array(np.array(value, dtype=np.float32), attr.t.name)
                    )
