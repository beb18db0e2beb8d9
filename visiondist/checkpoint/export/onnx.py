"""format=onnx: the eval-mode model as an ONNX graph with the names of what it predicts in its
metadata; every output's shape follows the inputs' alone (no count that depends on the data), as
TensorRT's engines want. `onnx_check.py` runs the file under ONNX Runtime against PyTorch.

- Classifier: `images` (N, 3, S, S), normalised -> `logits` (N, classes); dynamo exporter.
- DETR-class detector: `images` (N, 3, S, S), float in [0, 1], each resized to the model's side S
  (bilinear, antialiased where the model's processor is: `DetrForExport.resized`), and `sizes` (N,
  2), the originals' (height, width) -> `boxes` (N, K, 4, x1 y1 x2 y2 in the original's pixels),
  `labels` (N, K), `scores` (N, K), `detections` (N), K = its queries; dynamo exporter.
- torchvision detector or ViTDet: `images` (N, 3, H, W), the originals in the corners of one zero
  canvas (`onnx_batch.canvas`), and `sizes` (N, 2) -> the same outputs, K = its detections per
  image, padded (label 0, score 0) after the `detections` real ones, plus a mask model's `masks` (N,
  K, 1, H, W); the one-image graph of the TorchScript-based exporter, with the eager model's resize
  (`onnx_resize.py`), in a `Loop` over the batch (`onnx_batch.py`).

Metadata keys (`onnx.load(path).metadata_props`, `onnxruntime.InferenceSession(path).get_modelmeta()
.custom_metadata_map`): `model` (the model's config name, e.g. `fasterrcnn_mobilenet_v3`), `source`
(JSON object: the checkpoint's path, its step, and "weights" where they are its EMA), `classes`
(a classifier: JSON list, logit i is class i), `preprocessing` (a classifier: JSON object of the
run's eval mean, std, crop_pct and interpolation), `labels` (a detector: JSON object, label k ->
{"category_id": COCO category id, "name"}; 0 is the background), `input` (a detector: JSON object,
how its images are given: {"images": "resized", "side": S, "antialias": bool} or {"images":
"canvas"}), `score_thresh` (a torchvision detector: the Constant nodes holding its score thresholds,
for `onnx_detector.set_score_thresholds`).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from visiondist.checkpoint.export.half import halved
from visiondist.checkpoint.export.onnx_batch import loop_batch_of_one
from visiondist.checkpoint.export.onnx_detector import export_detector_onnx
from visiondist.checkpoint.export.preprocessing import name_metadata, preprocessing_metadata
from visiondist.checkpoint.export.quantize import (
    calibration_images,
    classifier_feeds,
    one_image_feeds,
    quantize,
)
from visiondist.checkpoint.export.trained import Trained, example_images
from visiondist.models.detr import DetrDetector, DetrForExport

log = logging.getLogger(__name__)


# the metadata key saying how a detector graph's images are given (the module's docstring)
INPUT_METADATA = "input"
# the metadata key of a graph whose network is not float32 ("float16", "int8"), and of the images
# an int8 graph was calibrated on
PRECISION_METADATA = "precision"
CALIBRATION_METADATA = "calibrated_on"
# the ONNX opset a graph is written in (opset=): 18 has Resize's antialias (a DETR's resize) and the
# reductions' axes as inputs; ONNX Runtime >= 1.14 and TensorRT 10 read it
OPSET = 18


def write_onnx(
    trained: Trained,
    path: Path,
    out: Path,
    opset: Optional[int] = None,
    half: bool = False,
    int8: bool = False,
) -> list[Path]:
    """The ONNX file of `trained`'s model at `path` (a temporary name of `out`), the names of its
    outputs in its metadata_props (key -> JSON text); nothing else.

    Args:
        trained: the run's model and what it records (`load_trained`).
        path: where to write (a temporary name of `out`, renamed by `export`).
        out: the export's final path.
        opset: the ONNX opset (default `OPSET`).
        half: the network's layers in float16 (`half.py`), inputs and outputs float32.
        int8: the convolutions and matrix products quantized to int8, calibrated on the run's
            train images (`quantize.py`).

    Returns:
        No other file ([]).
    """
    opset = int(opset or OPSET)
    metadata = {**name_metadata(trained), **preprocessing_metadata(trained)}
    family = trained.cfg.model.family
    # a float16 copy of the network (the run's model stays as it is, for the check)
    model = halved(trained.model, family) if half else trained.model
    metadata[PRECISION_METADATA] = "float16" if half else "float32"
    calibration = None
    if int8:
        calibration, described = calibration_images(trained.cfg)
        metadata[PRECISION_METADATA] = "int8"
        metadata[CALIBRATION_METADATA] = described
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
                opset_version=opset,
                input_names=["images"],
                output_names=["logits"],
                dynamic_shapes=({0: batch},),  # the images, whatever the argument's name
                external_data=False,
                verbose=False,
            )
        assert program is not None  # dynamo=True returns the program
        program.model.metadata_props.update(metadata)
        program.save(str(path))
        if calibration is not None:
            quantize(path, path, classifier_feeds(calibration))
    elif family in ("torchvision", "vitdet"):
        metadata[INPUT_METADATA] = json.dumps({"images": "canvas"})
        example = example_images(trained.cfg, 1)[0]
        export_detector_onnx(model, example, path, metadata, opset, calibration)
    elif family == "detr":
        assert isinstance(model, DetrDetector)  # what model.family=detr builds (half: a copy)
        metadata[INPUT_METADATA] = json.dumps(
            {"images": "resized", "side": model.img_size, "antialias": model.arch.antialias}
        )
        _export_detr_onnx(model, path, metadata, opset, calibration)
    else:
        raise ValueError(
            f"format=onnx is not supported for model.family={family}: export format=safetensors"
        )
    return []


def _export_detr_onnx(
    model: DetrDetector,
    path: Path,
    metadata: dict[str, str],
    opset: int = OPSET,
    calibration: Optional[list[torch.Tensor]] = None,
) -> None:
    """A DETR-class detector (`DetrForExport`: images (N, 3, S, S) resized to the model's side and
    their original sizes (N, 2) -> every query's box, label and score) with torch.export and a
    dynamic batch; where the library's code takes the batch as a Python number (RT-DETRv2's and
    D-FINE's `len(features)`), traced for one image and run per image by a `Loop`
    (`loop_batch_of_one`). The library's shape assertions are switched off while it is traced (its
    own switch, TRANSFORMERS_DISABLE_TORCH_CHECK): ONNX has no operator for them."""
    outputs = ["boxes", "labels", "scores", "detections"]
    side = model.img_size
    generator = torch.Generator().manual_seed(0)
    example = (
        torch.rand(2, 3, side, side, generator=generator),
        torch.tensor([[480, 640], [300, 200]]),
    )
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = _dynamo_export(
        DetrForExport(model).eval(),
        example,
        opset,
        ["images", "sizes"],
        outputs,
        {"images": {0: batch}, "sizes": {0: batch}},
    )
    program.model.metadata_props.update(metadata)
    if isinstance(program.model.graph.inputs[0].shape[0], int):  # the batch was taken as a number
        import onnx  # noqa: PLC0415 (onnx: the export extra)

        one = _dynamo_export(
            DetrForExport(model).eval(),
            (example[0][:1], example[1][:1]),
            opset,
            ["one_images", "one_sizes"],
            [f"one_{name}" for name in outputs],
            None,
        )
        one.model.metadata_props.update(metadata)
        one.save(str(path))
        if calibration is not None:
            given = json.loads(metadata[INPUT_METADATA])
            feeds = one_image_feeds(calibration, ("one_images", "one_sizes"), given)
            quantize(path, path, feeds)
        onnx.save(loop_batch_of_one(onnx.load(str(path)), outputs), str(path))
        return
    program.save(str(path))
    if calibration is not None:
        given = json.loads(metadata[INPUT_METADATA])
        quantize(path, path, one_image_feeds(calibration, ("images", "sizes"), given))


def _dynamo_export(module: nn.Module, example: tuple, opset: int, inputs, outputs, dynamic):
    """torch.onnx's dynamo export of a DETR-class detector's function, the library's shape checks
    off and the exporter's notes left out (check_onnx tests the graph)."""
    before = os.environ.get("TRANSFORMERS_DISABLE_TORCH_CHECK")
    os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                example,
                dynamo=True,
                opset_version=opset,
                input_names=inputs,
                output_names=outputs,
                external_data=False,
                dynamic_shapes=dynamic,
                verbose=False,
            )
    finally:
        if before is None:
            os.environ.pop("TRANSFORMERS_DISABLE_TORCH_CHECK", None)
        else:
            os.environ["TRANSFORMERS_DISABLE_TORCH_CHECK"] = before
    assert program is not None  # dynamo=True returns the program
    return program
