"""format=pt2: a classifier as torch.export's ExportedProgram, PyTorch's successor to TorchScript
(torch 2.15 warns at every torch.jit call): normalised images (N, 3, S, S) at the run's input size
-> logits, for any batch N. What the safetensors export's sidecar says of the inputs (classes, size,
mean / std, interpolation, crop, decoding) travels inside the archive as `visiondist.json`, read
with `torch.export.load(path, extra_files={"visiondist.json": ""})`. Detectors are refused: their
post-processing (NMS, a number of boxes that depends on the image) does not export."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from visiondist.checkpoint.export.preprocessing import sidecar
from visiondist.checkpoint.export.trained import (
    LOGITS_COMPARED,
    Trained,
    example_images,
    logits_difference,
)
from visiondist.models import TASKS

SIDECAR = "visiondist.json"
USAGE = (
    'extra = {"visiondist.json": ""}; program = torch.export.load(path, extra_files=extra); info '
    '= json.loads(extra["visiondist.json"]); logits = program.module()(images), images (N, 3, S, '
    'S) resized to info["input_size"] and normalised with info["mean"] / info["std"]'
)


def write_pt2(trained: Trained, path: Path, out: Path) -> list[Path]:
    """The ExportedProgram archive at `path` (a temporary name of `out`); nothing else.

    Args:
        trained: the run's model and what it records (`load_trained`).
        path: where to write (a temporary name of `out`, renamed by `export`).
        out: the export's final path.

    Returns:
        No other file ([]).
    """
    family = trained.cfg.model.family
    if TASKS[family] != "classification":
        other = (
            "format=onnx (any image size) or format=hf"
            if family == "detr"
            else (
                "format=onnx (any image size)"
                + (" or format=torchscript" if family == "torchvision" else "")
            )
        )
        raise ValueError(
            "format=pt2 exports classifiers: a detector's post-processing (NMS, a number of "
            f"boxes that depends on the image) does not go through torch.export; export {other}"
        )
    example = example_images(trained.cfg)
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        program = torch.export.export(
            trained.model.eval(), (example,), dynamic_shapes=({0: batch},)
        )
    info = {k: v for k, v in sidecar(trained).items() if k not in ("library", "create", "usage")}
    info["usage"] = USAGE
    with open(path, "wb") as file:  # a file object: torch.export.save names no suffix then
        torch.export.save(program, file, extra_files={SIDECAR: json.dumps(info, indent=2)})
    return []


def check_pt2(trained: Trained, path: Path) -> str:
    """One line: the saved program, loaded back, against the PyTorch model on random images at
    batches 1 and 3 (the program was traced at 2)."""
    # torch 2.11 reads the archive into read-only buffers, and warns so once
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The given buffer is not writable", category=UserWarning
        )
        program = torch.export.load(str(path)).module()
    diff = logits_difference(trained, program)
    return f"torch.export program vs PyTorch: {LOGITS_COMPARED}, max abs difference {diff:.3g}"
