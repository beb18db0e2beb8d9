"""format=torchscript: a ViT traced on example images, a torchvision detector scripted; ViTDet
refused (format=onnx)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from visiondist.checkpoint.export.script_resize import exact_script_resize
from visiondist.checkpoint.export.trained import (
    LOGITS_COMPARED,
    Trained,
    detector_examples,
    example_images,
    logits_difference,
)


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
        if family == "vit":
            scripted = torch.jit.trace(model, example_images(trained.cfg))
        else:
            with exact_script_resize():
                scripted = torch.jit.script(model)
        torch.jit.save(scripted, str(path))
    return []


def check_torchscript(trained: Trained, path: Path) -> str:
    """One line: the saved file, loaded back, against the PyTorch model: a ViT's logits of 1 and 3
    random images (traced at 2), a detector's boxes on up to 4 val images that hold objects (a
    random image where the data is not on this machine), each alone."""
    with warnings.catch_warnings():  # newer torch calls torch.jit.load deprecated
        warnings.simplefilter("ignore", FutureWarning)
        loaded = torch.jit.load(str(path))
    if trained.cfg.model.family == "vit":
        diff = logits_difference(trained, loaded)
        return f"TorchScript vs PyTorch: {LOGITS_COMPARED}, max abs difference {diff:.3g}"
    examples, source = detector_examples(trained.cfg, 4)
    boxes, worst = 0, 0.0
    for name, image in examples:
        with torch.no_grad(), warnings.catch_warnings():
            # a scripted detector returns (losses, detections) and says so each call
            warnings.filterwarnings("ignore", message=".*always returns a", category=UserWarning)
            ours = loaded([image])[1][0]["boxes"]
            theirs = trained.model([image])[0]["boxes"]
        if ours.shape != theirs.shape:
            return f"TorchScript vs PyTorch: {len(ours)} boxes against {len(theirs)} on {name}"
        boxes += len(ours)
        worst = max(worst, float((ours - theirs).abs().max()) if ours.numel() else 0.0)
    what = (
        examples[0][0]
        if len(examples) == 1 and source is None
        else f"{len(examples)} {trained.cfg.data.val_split} images"
        + (f" of {source}" if source else "")
    )
    return (
        f"TorchScript vs PyTorch: {boxes} boxes of {what} compared, max abs difference {worst:.3g}"
    )
