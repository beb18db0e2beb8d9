"""Export a trained run: one consolidated file that the model's own library loads without visiondist.

- `safetensors`: the unsharded weights under the anchor library's key names (timm's for ViTs: fused `qkv`;
  torchvision's for torchvision detectors) plus `<out>.json`, a sidecar saying how to build the model that loads
  them (`create` / `builder` + `kwargs`), the input size, the normalisation and the class names.
- `onnx`: the eval-mode model (classifier: images -> logits with a dynamic batch; torchvision detector: one image ->
  boxes, labels, scores), checked against PyTorch with ONNX Runtime when it is installed.
- `torchscript`: traced (classifiers) or scripted (torchvision detectors).

Weights come from a run's checkpoint (any parallel layout; DCP reads the shards into this one process) or, for a run
without checkpoints, its `model.safetensors`.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from visiondist.engine.checkpoint import list_checkpoints, load_model_state, read_trainer_state, resolve_checkpoint
from visiondist.models import TASKS, build_deferred
from visiondist.models.init import is_meta, materialize
from visiondist.models.vit import to_timm_state_dict
from visiondist.models.weights import load_local_weights, save_weights

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "onnx", "torchscript")


@dataclass
class Trained:
    cfg: DictConfig
    model: nn.Module  # eval mode, CPU, unsharded
    source: Path  # the checkpoint directory or weights file
    step: Optional[int]
    classes: Optional[list[str]]


def load_trained(run_dir: Path, step: "Optional[int | str]" = None) -> Trained:
    """The run's model with its trained weights: checkpoint `step` (default the latest; "best": the best kept by
    trainer.best_metric), else model.safetensors."""
    from visiondist.config.compose import run_config
    from visiondist.plan import check

    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    check(cfg, mandatory=False)  # export reads no data
    torch.manual_seed(0)
    model, _ = build_deferred(cfg.model, weights=False)  # every tensor comes from the run's files
    if is_meta(model):
        materialize(model, "cpu", None)
    model.eval()
    if cfg.model.family != "vit":  # exported for fp32 inference: the bf16 box hooks have nothing to do
        from visiondist.models.detection import drop_fp32_hooks

        drop_fp32_hooks(model)
    if step is not None or list_checkpoints(run_dir):
        source = resolve_checkpoint(str(run_dir), step)
        load_model_state(source, model)
        state = read_trainer_state(source)
        return Trained(cfg, model, source, int(state["step"]), state.get("classes"))
    source = run_dir / "model.safetensors"
    if not source.is_file():
        raise FileNotFoundError(f"{run_dir} has neither checkpoints nor model.safetensors: nothing to export")
    load_local_weights(model, str(source))
    return Trained(cfg, model, source, None, None)


def _input_size(cfg: DictConfig) -> int:
    return int(cfg.model.img_size) if cfg.model.family == "vit" else int(cfg.model.max_size)


def timm_data_config(trained: Trained) -> dict[str, Any]:
    """The run's eval preprocessing as entries of timm's `pretrained_cfg` (`create["pretrained_cfg_overlay"]`): what
    `timm.data.resolve_model_data_config(model)` reads (input size, interpolation, crop, mean / std; the test-time
    ones equal to them), plus the head's size and the class names."""
    cfg, size = trained.cfg, int(trained.cfg.model.img_size)
    crop_pct = float(cfg.data.crop_pct)
    overlay: dict[str, Any] = {
        "input_size": [3, size, size], "test_input_size": [3, size, size], "fixed_input_size": True,
        "interpolation": str(cfg.data.get("interpolation", "bilinear")), "crop_pct": crop_pct,
        "test_crop_pct": crop_pct, "crop_mode": "center",
        "mean": [float(v) for v in cfg.data.mean], "std": [float(v) for v in cfg.data.std],
        "num_classes": int(cfg.model.num_classes)}
    if trained.classes:
        overlay["label_names"] = list(trained.classes)
    return overlay


def sidecar(trained: Trained) -> dict[str, Any]:
    """How to rebuild the model that loads the exported weights, and what its inputs are."""
    cfg, m = trained.cfg, trained.cfg.model
    info: dict[str, Any] = {
        "model": m.name,
        "task": TASKS[m.family],
        "num_classes": int(m.num_classes),
        "classes": trained.classes,
        "input_size": _input_size(cfg),
        "mean": list(cfg.data.mean),
        "std": list(cfg.data.std),
        "source": {"path": str(trained.source), "step": trained.step},
    }
    if m.family == "vit":
        info.update(interpolation=str(cfg.data.get("interpolation", "bilinear")), crop_pct=float(cfg.data.crop_pct))
        create = {"model_name": m.timm_name or "vit_base_patch16_224", "num_classes": int(m.num_classes),
                  "img_size": int(m.img_size), "patch_size": int(m.patch_size), "embed_dim": int(m.embed_dim),
                  "depth": int(m.depth), "num_heads": int(m.num_heads), "mlp_ratio": float(m.mlp_ratio),
                  "qkv_bias": bool(m.qkv_bias),
                  # timm.data.resolve_model_data_config(model) then gives the run's preprocessing, not timm's
                  # defaults for model_name (224 px, its mean / std and crop)
                  "pretrained_cfg_overlay": timm_data_config(trained)}
        info.update(library="timm", create=create,
                    usage="model = timm.create_model(**create, pretrained=False); model.load_state_dict("
                          "safetensors.torch.load_file(path), strict=True); the run's eval preprocessing: "
                          "timm.data.create_transform(**timm.data.resolve_model_data_config(model))")
    elif m.family == "torchvision":
        kwargs = {"weights": None, "weights_backbone": None, "num_classes": int(m.num_classes) + 1,
                  "min_size": int(m.min_size), "max_size": int(m.max_size),
                  **OmegaConf.to_container(m.kwargs, resolve=True)}
        info.update(library="torchvision", builder=f"torchvision.models.detection.{m.arch}", kwargs=kwargs,
                    usage="builder(**kwargs).load_state_dict(safetensors.torch.load_file(path), strict=True); "
                          "labels are 1..num_classes (0 is the background)")
        if float(m.anchor_scale) != 1.0 or m.roi_sampling_ratio is not None:
            info["not_in_kwargs"] = {
                "anchor_scale": float(m.anchor_scale), "roi_sampling_ratio": m.roi_sampling_ratio,
                "note": "the weights load unchanged; to reproduce the outputs exactly, scale the builder's anchor "
                        "sizes (rpn_anchor_generator) and set box_roi_pool's sampling_ratio likewise"}
    else:
        info.update(library="visiondist", usage="visiondist.models.build_model(config.model), then load_state_dict; "
                                                "no other library has this architecture")
    return info


def export_state_dict(trained: Trained) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu().contiguous() for k, v in trained.model.state_dict().items()}
    return to_timm_state_dict(state) if trained.cfg.model.family == "vit" else state


def _example(trained: Trained, batch: int = 2) -> torch.Tensor:
    size = _input_size(trained.cfg)
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def export(trained: Trained, fmt: str, out: Path) -> list[Path]:
    """Write the export; returns the files written (each to a temporary name, then renamed)."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    written = [out]
    if fmt == "safetensors":
        save_weights(export_state_dict(trained), tmp, metadata={"format": "pt"})
        meta = out.with_suffix(".json")
        meta.write_text(json.dumps(sidecar(trained), indent=2))
        written.append(meta)
    elif fmt == "onnx":
        _export_onnx(trained, tmp)
    else:
        _export_torchscript(trained, tmp)
    tmp.replace(out)
    return written


def _export_onnx(trained: Trained, path: Path) -> None:
    model, family = trained.model, trained.cfg.model.family
    if family == "vit":
        batch = torch.export.Dim("batch", min=1, max=4096)
        program = torch.onnx.export(model, (_example(trained),), dynamo=True, input_names=["images"],
                                    output_names=["logits"], dynamic_shapes={"x": {0: batch}}, external_data=False)
        program.save(str(path))
    elif family == "torchvision":
        _export_detector_onnx(model, _example(trained, 1)[0], path)
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


def _export_detector_onnx(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    """torchvision's detectors through the TorchScript-based exporter (opset >= 11), one image per call. Traced with
    score thresholds that every box passes, then the graph's threshold constants are set to the model's and named in
    its metadata (`THRESH_METADATA`); without the onnx package, traced with the model's own thresholds."""

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
                    "image gets no proposal, the graph fails on images with boxes): pip install onnx")
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
        return
    meta = {role: {"nodes": [node.name for node in nodes], "value": wanted[role]} for role, nodes in found.items()}
    set_score_thresholds(proto, {role: m["value"] for role, m in meta.items()}, meta)
    proto.metadata_props.add(key=THRESH_METADATA, value=json.dumps(meta))
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


def _export_torchscript(trained: Trained, path: Path) -> None:
    model, family = trained.model, trained.cfg.model.family
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the input-size check is constant for the trace
        scripted = torch.jit.trace(model, _example(trained)) if family == "vit" else torch.jit.script(model)
    torch.jit.save(scripted, str(path))


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
        return f"{head} {self.boxes} boxes compared, max abs difference {self.max_diff:.2e} ({where})"


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
        from visiondist.data.imagefolder import read_rgb

        folder, annotations = coco_paths(cfg.data, cfg.data.val_split)
        coco = json.loads(annotations.read_text())
        with_objects = {a["image_id"] for a in coco.get("annotations", ()) if not a.get("iscrowd", 0)}
        files = [folder / i["file_name"] for i in coco.get("images", ()) if i["id"] in with_objects]
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
    for name, image in examples:
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
                failed = f"{Path(name).name}: {why}{message}"
            continue
        boxes += len(ref[0])
        onnx_boxes += len(got[0])
        diff = max(diff, _box_diff(ref, got))
    if len(examples) == 1:
        what = examples[0][0]
    else:
        paths = [Path(name) for name, _ in examples]
        what = f"{len(paths)} val images ({', '.join(p.name for p in paths)} in {paths[0].parent})"
    return OnnxCheck(diff, what, boxes=boxes, onnx_boxes=onnx_boxes, failed=failed)


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
        x = _example(trained)
        with torch.no_grad():
            ref = [trained.model(x)]
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        return OnnxCheck(_max_diff(ref, got), f"{len(x)} random images")

    model = trained.model
    examples = _val_images(trained.cfg, images) or [("a random image", _example(trained, 1)[0])]
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
