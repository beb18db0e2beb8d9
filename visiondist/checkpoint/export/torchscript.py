"""format=torchscript: a ViT traced on example images, a torchvision detector scripted; ViTDet
refused (format=onnx)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from visiondist.checkpoint.export.trained import Trained, example_images


def write_torchscript(trained: Trained, path: Path, out: Path) -> list[Path]:
    """The TorchScript file at `path` (a temporary name of `out`); nothing else.

    Args:
        trained: the run's model and what it records (`load_trained`).
        path: where to write (a temporary name of `out`, renamed by `export`).
        out: the export's final path.

    Returns:
        No other file ([]).
    """
    model, family = trained.model, trained.cfg.model.family
    if family == "vitdet":
        raise ValueError(
            "format=torchscript is not supported for ViTDet (torch.jit.script cannot compile its "
            "ViT blocks, and a trace would fix the image size): export format=onnx (any image "
            "size) or format=safetensors"
        )
    if family == "detr":
        raise ValueError(
            "format=torchscript is not supported for DETR-class detectors (torch.jit.script "
            "cannot compile transformers' models): export format=onnx (any image size) or "
            "format=hf (transformers' from_pretrained directory)"
        )
    with torch.no_grad(), warnings.catch_warnings():
        # the input-size check is constant for the trace
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # newer torch calls torch.jit deprecated at each call: the user asked for this format, the
        # tool says so once
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.\w+` is deprecated", category=FutureWarning
        )
        scripted = (
            torch.jit.trace(model, example_images(trained.cfg))
            if family == "vit"
            else torch.jit.script(model)
        )
        torch.jit.save(scripted, str(path))
    return []
