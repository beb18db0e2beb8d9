"""The formats' writers (`WRITERS`: format -> its module's `write_<format>`) and `export`, which
writes a run's model in one of them to a temporary name and renames it into place, leaving no
half-written file where a writer fails."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

from visiondist.checkpoint.export.hf import write_hf
from visiondist.checkpoint.export.naflex import write_naflex
from visiondist.checkpoint.export.onnx import write_onnx
from visiondist.checkpoint.export.openvino import write_openvino
from visiondist.checkpoint.export.pt2 import write_pt2
from visiondist.checkpoint.export.state_dict import write_safetensors
from visiondist.checkpoint.export.torchscript import write_torchscript
from visiondist.checkpoint.export.trained import Trained

# format -> its writer: (the trained model, a temporary path, the final path) -> the other files it
# wrote
WRITERS = {
    "safetensors": write_safetensors,
    "onnx": write_onnx,
    "pt2": write_pt2,
    "torchscript": write_torchscript,
    "hf": write_hf,
    "naflex": write_naflex,
    "openvino": write_openvino,
}
FORMATS = tuple(WRITERS)


def export(
    trained: Trained,
    fmt: str,
    out: Path,
    opset: Optional[int] = None,
    half: bool = False,
    int8: bool = False,
) -> list[Path]:
    """Write the export; returns the files written (the main one, or the directory, to a temporary
    name, then renamed).

    Args:
        trained: the run's model and what it records (`load_trained`).
        fmt: the format, one of `FORMATS`.
        out: the export's path (its folder is made).
        opset: format=onnx: the ONNX opset (None: `onnx.OPSET`).
        half: format=onnx: the network in float16 (`half.py`).
        int8: format=onnx: convolutions and matrix products in int8 (`quantize.py`).

    Returns:
        `out`, then the other files its writer wrote (a sidecar, a directory's files).
    """
    if fmt not in WRITERS:
        raise ValueError(f"format={fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    try:
        if fmt == "onnx":
            others = write_onnx(trained, tmp, out, opset, half, int8)
        elif fmt == "openvino":
            others = write_openvino(trained, tmp, out, opset)
        else:
            others = WRITERS[fmt](trained, tmp, out)
    except BaseException:  # a conversion refused (int8), an interrupt: no half-written file left
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    if tmp.is_dir() and out.is_dir():  # a directory export (hf) replaces the previous one whole
        shutil.rmtree(out)
    tmp.replace(out)
    return [out, *others]
