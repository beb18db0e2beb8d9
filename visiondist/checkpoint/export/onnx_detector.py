"""format=onnx of a torchvision detector or ViTDet: the one-image graph of the TorchScript-based
exporter in a `Loop` over the batch (`onnx_batch.py`), and its score thresholds, traced at values
every box passes and then set to the model's in the graph's Constant nodes, named in its metadata
(`THRESH_METADATA`) so that `set_score_thresholds` can change them in the file."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from visiondist.checkpoint.export.onnx_batch import PaddedDetections, loop_over_batch
from visiondist.checkpoint.export.onnx_empty import empty_safe_decode
from visiondist.checkpoint.export.onnx_resize import exact_resize
from visiondist.checkpoint.export.quantize import one_image_feeds, quantize
from visiondist.models.detection import has_mask_head

log = logging.getLogger(__name__)


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


def export_detector_onnx(
    model: nn.Module,
    example: torch.Tensor,
    path: Path,
    metadata: dict[str, str],
    opset: int,
    calibration: Optional[list[torch.Tensor]] = None,
) -> None:
    """torchvision's detectors (ViTDet is one, on its own backbone) through the TorchScript-based
    exporter: the one-image graph (`PaddedDetections`: its detections padded to a fixed count, a
    mask model's masks to the canvas), resized to the sizes the eager model takes (`exact_resize`),
    run for each image of a batch by a `Loop` (`loop_over_batch`). Traced with score thresholds that
    every box passes, then the graph's threshold constants are set to the model's and named in its
    metadata (`THRESH_METADATA`, beside `metadata`)."""
    try:
        import onnx  # noqa: PLC0415 (onnx: the export extra)
    except ImportError:
        raise RuntimeError(
            "format=onnx of a detector needs the onnx package: pip install -e '.[export]'"
        ) from None
    masks = has_mask_head(model)
    outputs = ["boxes", "labels", "scores", "detections", *(["masks"] if masks else [])]
    one = PaddedDetections(model, masks).eval()
    # a canvas larger than the image: the trace tells their sizes apart
    canvas = example.new_zeros(3, example.shape[-2] + 8, example.shape[-1] + 16)
    axes = {"image": {1: "height", 2: "width"}, "canvas": {1: "H", 2: "W"}}
    if masks:
        axes["masks"] = {2: "H", 3: "W"}

    def trace(target: Path) -> None:
        # the tracer's notes: check_onnx tests the graph
        with exact_resize(), empty_safe_decode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                one,
                (example, canvas),
                str(target),
                dynamo=False,
                opset_version=opset,
                input_names=["image", "canvas"],
                output_names=outputs,
                dynamic_axes=axes,
            )

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
    if calibration is not None:  # the one-image graph: calibration reads its main graph
        onnx.save(proto, str(path))
        quantize(path, path, one_image_feeds(calibration, ("image", "canvas"), {}))
        proto = onnx.load(str(path))
    onnx.save(loop_over_batch(proto, outputs, one.k), str(path))


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
    nodes = {node.name: node for node in _all_nodes(proto.graph)}
    for role, value in values.items():
        for name in meta[role]["nodes"]:
            for attr in nodes[name].attribute:
                if attr.name == "value":
                    attr.t.CopyFrom(
                        numpy_helper.from_array(np.array(value, dtype=np.float32), attr.t.name)
                    )


def _all_nodes(graph) -> list:
    """The graph's nodes and those of its subgraphs (a batched detector's `Loop` body)."""
    out = []
    for node in graph.node:
        out.append(node)
        for attr in node.attribute:
            if attr.g is not None and attr.g.node:
                out.extend(_all_nodes(attr.g))
    return out
