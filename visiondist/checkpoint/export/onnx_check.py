"""The check of an ONNX or OpenVINO export: the runtime against PyTorch, on the logits of random
images (classifiers) or the detections on the run's val images (detectors), reported as one line
(`RuntimeCheck.summary`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, cast

import torch
from torch import nn

from visiondist.checkpoint.export.onnx import INPUT_METADATA, PRECISION_METADATA
from visiondist.checkpoint.export.onnx_batch import run_detector
from visiondist.checkpoint.export.onnx_detector import (
    THRESH_METADATA,
    set_score_thresholds,
    thresholds_set,
)
from visiondist.checkpoint.export.trained import Trained, detector_examples, example_images
from visiondist.models.detection import has_mask_head


@dataclass
class RuntimeCheck:
    """What `check_onnx` / `openvino_check` compared and how far the runtime was from PyTorch."""

    # largest |ONNX Runtime - PyTorch| over the outputs; inf when they differ in shape
    max_diff: float
    example: str  # the input: "2 random images", "a random image" or the val images' paths
    # detectors: the boxes PyTorch returned, compared with ONNX Runtime's
    boxes: Optional[int] = None
    onnx_boxes: Optional[int] = None  # detectors: the boxes ONNX Runtime returned
    failed: Optional[str] = None  # detectors: the first image ONNX Runtime failed on, and its error
    # set when the file's graph was compared with its score thresholds at 0
    lowered_from: Optional[dict] = None
    # mask models: the masks compared (those of boxes matched on both sides)
    masks: Optional[int] = None
    mask_diff: float = 0.0  # mask models: largest |ONNX Runtime - PyTorch| of a mask probability
    # detectors: the widest range of PyTorch's kept scores on one image
    score_spread: Optional[float] = None
    # the graph's network precision where not float32 ("float16"): compared with PyTorch's
    # float32, its differences are the precision's, not round-off
    precision: Optional[str] = None
    runtime: str = "ONNX Runtime"  # what ran the file
    # detectors: images on which the two returned different numbers of boxes (the totals may agree)
    counts_differ: int = 0
    images: int = 0  # detectors: the images compared

    def summary(self) -> str:
        """One line, e.g. "ONNX Runtime vs PyTorch: 37 boxes compared, max abs difference 2.1e-05
        (on ...)"."""
        head = (
            f"{self.runtime} ({self.precision} network) vs PyTorch (float32):"
            if self.precision
            else f"{self.runtime} vs PyTorch:"
        )
        if self.boxes is None:
            return (
                f"{head} logits of {self.example} compared, max abs difference {self.max_diff:.2e}"
            )
        where = f"on {self.example}"
        if self.lowered_from is not None:
            file = ", ".join(f"{role} {value:g}" for role, value in self.lowered_from.items())
            where += (
                f"; no box passed the file's score thresholds ({file}, kept in the file), so "
                "its graph was compared with them at 0 in memory"
            )
        if self.failed:
            rest = (
                f"; elsewhere {self.onnx_boxes} boxes compared, max abs difference "
                f"{self.max_diff:.2e}"
                if self.onnx_boxes
                else ""
            )
            return f"{head} {self.runtime} failed on {self.failed} ({where}){rest}"
        if self.onnx_boxes != self.boxes or self.counts_differ:
            return f"{head} {self._differ(where)}"
        if not self.boxes:
            return (
                f"{head} 0 boxes compared ({where}): both returned no box, which checks "
                "nothing of the outputs"
            )
        line = (
            f"{head} {self.boxes} boxes compared, max abs difference {self.max_diff:.2e} ({where})"
        )
        if self.masks is not None:
            line += (
                f"; {self.masks} masks (of the same boxes) compared, max abs difference "
                f"{self.mask_diff:.2e}"
            )
        if self.precision:  # not round-off: the accuracy line after it says what it costs
            return line
        if (
            self.max_diff > BOX_ROUND_OFF
            and self.score_spread is not None
            and self.score_spread < TIED_SPREAD
        ):
            line += (
                f"; expected for these weights: every score lies within {self.score_spread:.1e} "
                "of the others on its image (a barely trained model), so which of the near-tied "
                "boxes top-k keeps is float round-off's choice; a trained model's export "
                "compares to round-off"
            )
        elif self.max_diff > BOX_ROUND_OFF:
            spread = (
                ""
                if self.score_spread is None
                else f", with scores spread over {self.score_spread:.2f}"
            )
            line += (
                f"; warning: more than float round-off ({BOX_ROUND_OFF:g} px){spread}: the "
                "exported graph does not compute what PyTorch does"
            )
        return line

    def _differ(self, where: str) -> str:
        """The boxes' counts where the two sides kept others (in all, or on some images)."""
        on = (
            f" in all, and other counts on {self.counts_differ} of the {self.images} images"
            if self.counts_differ
            else ""
        )
        why = (
            f"the {self.precision} network's scores move boxes across the score threshold and NMS"
            if self.precision
            else "near-tied scores can make top-k and NMS keep other boxes"
        )
        return (
            f"the outputs differ: {self.runtime} returned {self.onnx_boxes} boxes, PyTorch "
            f"{self.boxes}{on} ({where}; {why})"
        )


# px: the largest box difference of a trained detector's export (3.8e-05 measured) and then some
BOX_ROUND_OFF = 1e-2
# a detector whose kept scores span less than this on every image has not learnt to tell its boxes
# apart (a few steps in: 3e-3; trained: most of [0, 1]): its top-k choice among them follows the
# last bits of the arithmetic
TIED_SPREAD = 0.05


def _max_diff(ref: list[torch.Tensor], got: list) -> float:
    diffs = []
    for r, g in zip(ref, got):
        g = torch.from_numpy(g)
        if r.shape != g.shape:
            return float("inf")
        diffs.append(float((r.double() - g.double()).abs().max()) if r.numel() else 0.0)
    return max(diffs)


def _box_diff(ref: list[torch.Tensor], got: list) -> float:
    """Largest difference between PyTorch's detections and ONNX Runtime's, taken as sets (the order
    of boxes whose scores tie is arbitrary): each box, on either side, against the nearest box of
    its label on the other side, and the scores of those pairs; inf when the counts differ or a
    label has no counterpart."""
    boxes, labels, scores = (r.double() for r in ref)
    other_boxes, other_labels, other_scores = (torch.from_numpy(g).double() for g in got)
    if other_boxes.shape != boxes.shape:
        return float("inf")
    if not len(boxes):
        return 0.0
    cost = (boxes[:, None] - other_boxes[None]).abs().amax(-1)
    cost[labels[:, None] != other_labels[None]] = float("inf")
    to_other, to_ref = cost.argmin(1), cost.argmin(0)
    return float(
        max(
            cost.amin(1).max(),
            cost.amin(0).max(),
            (scores - other_scores[to_other]).abs().max(),
            (other_scores - scores[to_ref]).abs().max(),
        )
    )


def _mask_diff(ref: list[torch.Tensor], got: list) -> tuple[int, float]:
    """(masks compared, largest probability difference): each PyTorch detection's mask against the
    mask of the ONNX Runtime detection of its label whose box is the same to float round-off
    (`BOX_ROUND_OFF`); a detection without such a counterpart (near-tied scores kept other boxes) is
    the box check's to report."""
    boxes, labels = ref[0].double(), ref[1]
    other_boxes, other_labels = torch.from_numpy(got[0]).double(), torch.from_numpy(got[1])
    if not len(boxes) or not len(other_boxes):
        return 0, 0.0
    cost = (boxes[:, None] - other_boxes[None]).abs().amax(-1)
    cost[labels[:, None] != other_labels[None]] = float("inf")
    pairs = [(i, int(j)) for i, j in enumerate(cost.argmin(1)) if cost[i, j] <= BOX_ROUND_OFF]
    other = torch.from_numpy(got[3])
    diffs = [float((ref[3][i].double() - other[j].double()).abs().max()) for i, j in pairs]
    return len(pairs), max(diffs, default=0.0)


def _proposals(model: nn.Module, image: torch.Tensor) -> Optional[int]:
    """How many boxes a two-stage detector's RPN proposes on `image` (None: no RPN)."""
    if not hasattr(model, "rpn"):
        return None
    # torchvision's parts (nn.Module types an attribute as a tensor or a module)
    transform, rpn = cast(nn.Module, model.transform), cast(nn.Module, model.rpn)
    backbone = cast(nn.Module, model.backbone)
    with torch.no_grad():
        images, _ = transform([image])
        proposals, _ = rpn(images, backbone(images.tensors))
    return len(proposals[0])


def _compare_detector(
    model: nn.Module,
    session,
    examples: list[tuple[str, torch.Tensor]],
    source: Optional[str] = None,
) -> RuntimeCheck:
    """PyTorch's detections on each example alone against ONNX Runtime's on all of them in one
    batch (named, from `source` where not a path); where ONNX Runtime fails on the batch, each image
    is run alone, the boxes of those it fails on are left out of the comparison and the first
    failure is reported."""
    boxes = onnx_boxes = counts_differ = compared = 0
    diff, failed, spread = 0.0, None, None
    masks, mask_diff = (0, 0.0) if has_mask_head(model) else (None, 0.0)
    what, names = _describe([name for name, _ in examples], source)
    given = json.loads(session.get_modelmeta().custom_metadata_map.get(INPUT_METADATA, "{}"))
    images = [image for _, image in examples]
    try:
        results: list = run_detector(session, given, images)
    except Exception:  # onnxruntime's own error types: which image, below
        results = []
        for name, image in zip(names, images):
            try:
                results += run_detector(session, given, [image])
            except Exception as exc:
                results.append(None)
                if failed is None:
                    why = "the RPN proposes no box there: " if _proposals(model, image) == 0 else ""
                    # ONNX Runtime's
                    message = ". ".join(str(exc).strip().splitlines()[-1].split(". ")[-2:])[-200:]
                    failed = f"{name}: {why}{message}"
    for image, found in zip(images, results):
        if found is None:
            continue
        with torch.no_grad():
            out = model([image])[0]
        keys = ["boxes", "labels", "scores", *(["masks"] if masks is not None else [])]
        ref, got = [out[k] for k in keys], [found[k].numpy() for k in keys]
        boxes += len(ref[0])
        onnx_boxes += len(got[0])
        compared += 1
        counts_differ += len(ref[0]) != len(got[0])
        if len(ref[2]):
            spread = max(spread or 0.0, float(ref[2].max() - ref[2].min()))
        diff = max(diff, _box_diff(ref[:3], got[:3]))
        if masks is not None:
            compared, worst = _mask_diff(ref, got)
            masks, mask_diff = masks + compared, max(mask_diff, worst)
    return RuntimeCheck(
        diff,
        what,
        boxes=boxes,
        onnx_boxes=onnx_boxes,
        failed=failed,
        masks=masks,
        mask_diff=mask_diff,
        score_spread=spread,
        counts_differ=counts_differ,
        images=compared,
    )


def _describe(paths: list[str], source: Optional[str] = None) -> tuple[str, list[str]]:
    """What the examples are, in one phrase, and each one's name in it: one image by its path;
    several by their paths below the folder that holds them all (annotation file names may hold
    sub-folders), then that folder; images of a `source` (a packed split) by their names, then the
    source."""
    if source is not None:
        noun = "val image" if len(paths) == 1 else f"{len(paths)} val images"
        return f"{noun} ({', '.join(paths)} from {source})", paths
    if len(paths) == 1:
        return paths[0], [Path(paths[0]).name]
    folder = Path(os.path.commonpath([str(Path(p).parent) for p in paths]))
    names = [Path(p).relative_to(folder).as_posix() for p in paths]
    return f"{len(paths)} val images ({', '.join(names)} in {folder})", names


def _compared(
    trained: Trained, session, runtime: str, images: int
) -> tuple[RuntimeCheck, list[tuple[str, torch.Tensor]], Optional[str]]:
    """The runtime's `session` (ONNX Runtime's, or one answering as it) against PyTorch: a
    classifier's logits of 2 random images, a detector's detections on up to `images` val images
    in one batch against PyTorch on each alone. Returns the check and, for a detector, the examples
    and their source (for a second comparison)."""
    precision = session.get_modelmeta().custom_metadata_map.get(PRECISION_METADATA)
    precision = None if precision == "float32" else precision  # differences of round-off
    if trained.cfg.model.family == "vit":
        x = example_images(trained.cfg)
        with torch.no_grad():
            ref = [trained.model(x)]
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        check = RuntimeCheck(_max_diff(ref, got), f"{len(x)} random images", precision=precision)
        check.runtime = runtime
        return check, [], None
    examples, source = detector_examples(trained.cfg, images)
    check = _compare_detector(trained.model, session, examples, source)
    check.precision, check.runtime = precision, runtime
    return check, examples, source


def check_onnx(trained: Trained, path: Path, images: int = 4) -> Optional[RuntimeCheck]:
    """ONNX Runtime against PyTorch on example inputs (`_compared`); None when onnxruntime is not
    installed. Boxes are matched as sets. The exported file is compared at its own score thresholds
    (baked into the graph). Where no box comes out there, its graph is compared again with the
    thresholds set to 0 (in memory, PyTorch likewise), and the result says so: an empty output
    checks nothing."""
    try:
        import onnxruntime as ort  # noqa: PLC0415 (onnxruntime: the export extra)
    except ImportError:
        return None
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a failing run is reported in the result, not logged
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    check, examples, source = _compared(trained, session, "ONNX Runtime", images)
    if not examples or check.boxes or check.onnx_boxes or check.failed:
        return check
    try:
        import onnx  # noqa: PLC0415 (onnx: the export extra)

        proto = onnx.load(str(path))
        meta = json.loads({p.key: p.value for p in proto.metadata_props}[THRESH_METADATA])
    except (ImportError, KeyError):  # no onnx package, or a graph without its thresholds named
        return check
    zero = {role: 0.0 for role in meta}
    set_score_thresholds(proto, zero, meta)
    lowered = ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    with thresholds_set(trained.model, zero):
        again = _compare_detector(trained.model, lowered, examples, source)
    again.lowered_from = {role: m["value"] for role, m in meta.items()}
    again.precision = check.precision
    return again


def openvino_check(trained: Trained, path: Path, images: int = 4) -> str:
    """The check line of an OpenVINO IR (`openvino.OpenVinoSession`, float32 on the CPU), compared
    as `check_onnx` compares an ONNX file (`_compared`)."""
    from visiondist.checkpoint.export.openvino import OpenVinoSession  # noqa: PLC0415

    return _compared(trained, OpenVinoSession(path), "OpenVINO", images)[0].summary()
