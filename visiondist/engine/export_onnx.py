"""ONNX export and its check: the eval-mode model as an ONNX graph (classifier: images -> logits with a dynamic batch,
dynamo exporter; torchvision detector: one image of any size -> boxes, labels, scores, TorchScript-based exporter)
with the names of what it predicts in the graph's metadata, and `check_onnx`, which runs the file under ONNX Runtime
against the PyTorch model.

Metadata keys (`onnx.load(path).metadata_props`, `onnxruntime.InferenceSession(path).get_modelmeta()
.custom_metadata_map`): `classes` (a classifier: JSON list, logit i is class i), `labels` (a detector: JSON object,
label k -> {"category_id": COCO category id, "name"}; 0 is the background), `score_thresh` (a detector: the
Constant nodes holding its score thresholds, for `set_score_thresholds`).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from omegaconf import DictConfig
from torch import nn

if TYPE_CHECKING:
    from visiondist.engine.export import Trained

log = logging.getLogger(__name__)


def input_size(cfg: DictConfig) -> int:
    return int(cfg.model.img_size) if cfg.model.family == "vit" else int(cfg.model.max_size)


def example_images(cfg: DictConfig, batch: int = 2) -> torch.Tensor:
    """`batch` random images of the model's input size (the same ones each call)."""
    size = input_size(cfg)
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def write_onnx(trained: Trained, path: Path, metadata: dict[str, str]) -> None:
    """The ONNX file of `trained`'s model at `path`, with `metadata` (key -> JSON text) in its metadata_props."""
    model, family = trained.model, trained.cfg.model.family
    if family == "vit":
        batch = torch.export.Dim("batch", min=1, max=4096)
        program = torch.onnx.export(model, (example_images(trained.cfg),), dynamo=True, input_names=["images"],
                                    output_names=["logits"], dynamic_shapes={"x": {0: batch}}, external_data=False)
        program.model.metadata_props.update(metadata)
        program.save(str(path))
    elif family == "torchvision":
        _export_detector_onnx(model, example_images(trained.cfg, 1)[0], path, metadata)
    else:
        raise ValueError(f"format=onnx is not supported for model.family={family}: export format=safetensors")


# Score thresholds a torchvision detector's graph is traced with, replaced by the model's own afterwards: below 0, so
# that the trace sees proposals and detections whatever the example image (a graph traced where the RPN proposes
# nothing keeps that branch and fails on every image with boxes), and unlike any other constant of the graph.
_TRACE_THRESH = {"rpn": -0.123456, "box": -0.234567}
THRESH_METADATA = "score_thresh"  # the ONNX metadata key: {role: {"nodes": [Constant nodes], "value": threshold}}


def score_thresholds(model: nn.Module) -> dict[str, nn.Module]:
    """The modules holding a torchvision detector's `score_thresh`, by role: "rpn" (Faster R-CNN's proposals) and
    "box" (the detections: Faster R-CNN's roi_heads, RetinaNet / FCOS themselves)."""
    owners = {"rpn": model.rpn} if hasattr(model, "rpn") else {}
    owners["box"] = model.roi_heads if hasattr(model, "roi_heads") else model
    return owners


class _thresholds_set:
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


def _export_detector_onnx(model: nn.Module, example: torch.Tensor, path: Path, metadata: dict[str, str]) -> None:
    """torchvision's detectors through the TorchScript-based exporter (opset >= 11), one image per call. Traced with
    score thresholds that every box passes, then the graph's threshold constants are set to the model's and named in
    its metadata (`THRESH_METADATA`, beside `metadata`); without the onnx package, traced with the model's own
    thresholds and no metadata."""

    def trace(target: Path) -> None:
        with warnings.catch_warnings():  # the tracer's notes on torchvision's code: check_onnx tests the graph
            warnings.simplefilter("ignore")
            torch.onnx.export(model, ([example],), str(target), dynamo=False, opset_version=17,
                              input_names=["image"], output_names=["boxes", "labels", "scores"],
                              dynamic_axes={"image": {1: "height", 2: "width"}, "boxes": {0: "detections"},
                                            "labels": {0: "detections"}, "scores": {0: "detections"}})

    try:
        import onnx
    except ImportError:
        log.warning("onnx is not installed: the detector is traced with its own score thresholds (if the example "
                    "image gets no proposal, the graph fails on images with boxes) and the file carries no %s: "
                    "pip install onnx", ", ".join(metadata) or "metadata")
        trace(path)
        return
    wanted = {role: float(owner.score_thresh) for role, owner in score_thresholds(model).items()}
    with _thresholds_set(model, {role: _TRACE_THRESH[role] for role in wanted}):
        trace(path)
    proto = onnx.load(str(path))
    found = {role: _constants_equal(proto, _TRACE_THRESH[role]) for role in wanted}  # RetinaNet, FCOS: per level
    if not all(found.values()):  # another torchvision: the plain trace
        log.warning("the score thresholds were not found in the traced graph: traced with the model's own")
        trace(path)
        proto = onnx.load(str(path))
    else:
        meta = {role: {"nodes": [node.name for node in nodes], "value": wanted[role]} for role, nodes in found.items()}
        set_score_thresholds(proto, {role: m["value"] for role, m in meta.items()}, meta)
        proto.metadata_props.add(key=THRESH_METADATA, value=json.dumps(meta))
    for key, value in metadata.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(path))


def _constants_equal(proto, value: float) -> list:
    """The graph's Constant nodes holding the one float32 `value`."""
    import numpy as np
    from onnx import numpy_helper

    out = []
    for node in proto.graph.node:
        if node.op_type != "Constant":
            continue
        for attr in node.attribute:
            if attr.name == "value":
                array = numpy_helper.to_array(attr.t)
                if array.size == 1 and array.dtype == np.float32 and array.item() == np.float32(value).item():
                    out.append(node)
    return out


def set_score_thresholds(proto, values: dict[str, float], meta: Optional[dict] = None) -> None:
    """Set the score thresholds of a detector graph exported here (an `onnx.ModelProto`, changed in place): values
    by role ("rpn", "box"), the nodes from its metadata (or `meta`)."""
    import numpy as np
    from onnx import numpy_helper

    if meta is None:
        meta = json.loads({p.key: p.value for p in proto.metadata_props}[THRESH_METADATA])
    nodes = {node.name: node for node in proto.graph.node}
    for role, value in values.items():
        for name in meta[role]["nodes"]:
            for attr in nodes[name].attribute:
                if attr.name == "value":
                    attr.t.CopyFrom(numpy_helper.from_array(np.array(value, dtype=np.float32), attr.t.name))



@dataclass
class OnnxCheck:
    """What `check_onnx` compared and how far ONNX Runtime was from PyTorch."""

    max_diff: float  # largest |ONNX Runtime - PyTorch| over the outputs; inf when they differ in shape
    example: str  # the input: "2 random images", "a random image" or the val images' paths
    boxes: Optional[int] = None  # detectors: the boxes PyTorch returned, compared with ONNX Runtime's
    onnx_boxes: Optional[int] = None  # detectors: the boxes ONNX Runtime returned
    failed: Optional[str] = None  # detectors: the first image ONNX Runtime failed on, and its error
    lowered_from: Optional[dict] = None  # set when the file's graph was compared with its score thresholds at 0

    def summary(self) -> str:
        """One line, e.g. "ONNX Runtime vs PyTorch: 37 boxes compared, max abs difference 2.1e-05 (on ...)"."""
        head = "ONNX Runtime vs PyTorch:"
        if self.boxes is None:
            return f"{head} logits of {self.example} compared, max abs difference {self.max_diff:.2e}"
        where = f"on {self.example}"
        if self.lowered_from is not None:
            file = ", ".join(f"{role} {value:g}" for role, value in self.lowered_from.items())
            where += (f"; at the file's score thresholds ({file}) no box came out, so its graph was compared with "
                      "them set to 0")
        if self.failed:
            rest = (f"; elsewhere {self.onnx_boxes} boxes compared, max abs difference {self.max_diff:.2e}"
                    if self.onnx_boxes else "")
            return f"{head} ONNX Runtime failed on {self.failed} ({where}){rest}"
        if self.onnx_boxes != self.boxes:
            return (f"{head} the outputs differ: ONNX Runtime returned {self.onnx_boxes} boxes, PyTorch {self.boxes} "
                    f"({where}; near-tied scores can make top-k and NMS keep other boxes)")
        if not self.boxes:
            return f"{head} 0 boxes compared ({where}): both returned no box, which checks nothing of the outputs"
        line = f"{head} {self.boxes} boxes compared, max abs difference {self.max_diff:.2e} ({where})"
        if self.max_diff > BOX_ROUND_OFF:
            line += (f"; warning: more than float round-off ({BOX_ROUND_OFF:g} px): the boxes differ, which a barely "
                     "trained model's near-tied scores can cause; check the export on a trained model's weights")
        return line


BOX_ROUND_OFF = 1e-2  # px: the largest box difference of a trained detector's export (3.8e-05 measured) and then some


def _max_diff(ref: list[torch.Tensor], got: list) -> float:
    diffs = []
    for r, g in zip(ref, got):
        g = torch.from_numpy(g)
        if r.shape != g.shape:
            return float("inf")
        diffs.append(float((r.double() - g.double()).abs().max()) if r.numel() else 0.0)
    return max(diffs)


def _box_diff(ref: list[torch.Tensor], got: list) -> float:
    """Largest difference between PyTorch's detections and ONNX Runtime's, taken as sets (the order of boxes whose
    scores tie is arbitrary): each box, on either side, against the nearest box of its label on the other side, and
    the scores of those pairs; inf when the counts differ or a label has no counterpart."""
    boxes, labels, scores = (r.double() for r in ref)
    other_boxes, other_labels, other_scores = (torch.from_numpy(g).double() for g in got)
    if other_boxes.shape != boxes.shape:
        return float("inf")
    if not len(boxes):
        return 0.0
    cost = (boxes[:, None] - other_boxes[None]).abs().amax(-1)
    cost[labels[:, None] != other_labels[None]] = float("inf")
    to_other, to_ref = cost.argmin(1), cost.argmin(0)
    return float(max(cost.amin(1).max(), cost.amin(0).max(), (scores - other_scores[to_other]).abs().max(),
                     (other_scores - scores[to_ref]).abs().max()))


def _val_images(cfg: DictConfig, limit: int) -> list[tuple[str, torch.Tensor]]:
    """(path, float CHW image in [0, 1]) of up to `limit` images of the run's val split that hold objects, in the
    annotation file's order; none when the data is not on this machine."""
    try:
        from visiondist.data import coco_paths
        from visiondist.data.coco import safe_image_path
        from visiondist.data.decode import read_rgb

        folder, annotations = coco_paths(cfg.data, cfg.data.val_split)
        coco = json.loads(annotations.read_text())
        with_objects = {a["image_id"] for a in coco.get("annotations", ()) if not a.get("iscrowd", 0)}
        files = [safe_image_path(folder, i["file_name"]) for i in coco.get("images", ()) if i["id"] in with_objects]
    except Exception:  # no data here (or not COCO-format): a random image serves
        return []
    images = []
    for path in files:
        try:
            image = read_rgb(str(path))
        except OSError:
            continue
        images.append((str(path), torch.from_numpy(image).permute(2, 0, 1).float().div_(255)))
        if len(images) == limit:
            break
    return images


def _proposals(model: nn.Module, image: torch.Tensor) -> Optional[int]:
    """How many boxes a two-stage detector's RPN proposes on `image` (None: no RPN)."""
    if not hasattr(model, "rpn"):
        return None
    with torch.no_grad():
        images, _ = model.transform([image])
        proposals, _ = model.rpn(images, model.backbone(images.tensors))
    return len(proposals[0])


def _compare_detector(model: nn.Module, session, examples: list[tuple[str, torch.Tensor]]) -> OnnxCheck:
    """PyTorch's and ONNX Runtime's detections on each example; where ONNX Runtime fails, the boxes of that image
    are left out of the comparison and the first failure is reported."""
    boxes = onnx_boxes = 0
    diff, failed = 0.0, None
    what, names = _describe([name for name, _ in examples])
    for name, (_, image) in zip(names, examples):
        with torch.no_grad():
            out = model([image])[0]
        ref = [out["boxes"], out["labels"], out["scores"]]
        try:
            got = session.run(None, {session.get_inputs()[0].name: image.numpy()})
        except Exception as exc:  # onnxruntime's own error types
            if failed is None:
                why = ("the RPN proposes no box there, which torchvision's exported graph does not handle: "
                       if _proposals(model, image) == 0 else "")
                message = ". ".join(str(exc).strip().splitlines()[-1].split(". ")[-2:])[-200:]  # ONNX Runtime's
                failed = f"{name}: {why}{message}"
            continue
        boxes += len(ref[0])
        onnx_boxes += len(got[0])
        diff = max(diff, _box_diff(ref, got))
    return OnnxCheck(diff, what, boxes=boxes, onnx_boxes=onnx_boxes, failed=failed)


def _describe(paths: list[str]) -> tuple[str, list[str]]:
    """What the examples are, in one phrase, and each one's name in it: one image by its path; several by their
    paths below the folder that holds them all (annotation file names may hold sub-folders), then that folder."""
    if len(paths) == 1:
        return paths[0], [Path(paths[0]).name]
    folder = Path(os.path.commonpath([str(Path(p).parent) for p in paths]))
    names = [Path(p).relative_to(folder).as_posix() for p in paths]
    return f"{len(paths)} val images ({', '.join(names)} in {folder})", names


def check_onnx(trained: Trained, path: Path, images: int = 3) -> Optional[OnnxCheck]:
    """ONNX Runtime against PyTorch on example inputs; None when onnxruntime is not installed.

    Classifier: the logits of 2 random images. Detector: the boxes, labels and scores of up to `images` of the run's
    val images that hold objects (a trained detector finds boxes there), else of a random image; boxes are matched
    as sets. The exported file is compared at its own score thresholds (baked into the graph). Where no box comes
    out there, its graph is compared again with the thresholds set to 0 (in memory, PyTorch likewise), and the
    result says so: an empty output checks nothing."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a failing run is reported in the result, not logged
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    if trained.cfg.model.family == "vit":
        x = example_images(trained.cfg)
        with torch.no_grad():
            ref = [trained.model(x)]
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        return OnnxCheck(_max_diff(ref, got), f"{len(x)} random images")

    model = trained.model
    examples = _val_images(trained.cfg, images) or [("a random image", example_images(trained.cfg, 1)[0])]
    check = _compare_detector(model, session, examples)
    if check.boxes or check.onnx_boxes or check.failed:
        return check
    try:
        import onnx

        proto = onnx.load(str(path))
        meta = json.loads({p.key: p.value for p in proto.metadata_props}[THRESH_METADATA])
    except (ImportError, KeyError):  # no onnx package, or a graph without its thresholds named
        return check
    zero = {role: 0.0 for role in meta}
    set_score_thresholds(proto, zero, meta)
    lowered = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with _thresholds_set(model, zero):
        check = _compare_detector(model, lowered, examples)
    check.lowered_from = {role: m["value"] for role, m in meta.items()}
    return check

