"""format=openvino: the ONNX graph (`onnx.py`, batched, float32) converted by OpenVINO into its IR,
`<out>.xml` and `<out>.bin` (weights kept float32: `save_model`'s float16 compression off), with
the graph's metadata in a sidecar `<out>.json` (classes or labels, a detector's `input`), the keys
of the ONNX file's metadata. `OpenVinoSession` runs an IR on OpenVINO's CPU plugin (a GPU plugin
where one is asked for and present) in float32 (the CPU plugin's default on bf16-capable CPUs is
bf16), with ONNX Runtime's session calls, so that the ONNX check (`onnx_check.py`) and the runtime
model (`runtimes.py`) run it as they run an ONNX file.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np

from visiondist.checkpoint.export.onnx import write_onnx
from visiondist.checkpoint.export.trained import Trained


def _openvino():
    try:
        import openvino  # noqa: PLC0415 (openvino: the openvino extra)
    except ImportError:
        raise ValueError("format=openvino needs OpenVINO: pip install -e '.[openvino]'") from None
    return openvino


def write_openvino(
    trained: Trained, path: Path, out: Path, opset: Optional[int] = None
) -> list[Path]:
    """The IR of `trained`'s model: its .xml at `path` (a temporary name of `out`, renamed by
    `export`), its weights at `out`'s .bin, the sidecar at `out`'s .json.

    Returns:
        The .bin and the .json.
    """
    ov = _openvino()
    with tempfile.TemporaryDirectory() as work:
        graph = Path(work) / "model.onnx"
        write_onnx(trained, graph, graph, opset)
        import onnx  # noqa: PLC0415 (onnx: the export extra)

        meta = {
            p.key: p.value for p in onnx.load(str(graph), load_external_data=False).metadata_props
        }
        model = ov.convert_model(str(graph))
        for key, value in meta.items():
            model.set_rt_info(value, ["visiondist", key])
        ov.save_model(model, str(Path(work) / "model.xml"), compress_to_fp16=False)
        weights, sidecar = out.with_suffix(".bin"), out.with_suffix(".json")
        shutil.move(str(Path(work) / "model.bin"), weights)
        shutil.move(str(Path(work) / "model.xml"), path)
    sidecar.write_text(json.dumps({k: _json_or_text(v) for k, v in meta.items()}, indent=2) + "\n")
    return [weights, sidecar]


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


class _Output:
    def __init__(self, name: str):
        self.name = name


class _Meta:
    def __init__(self, meta: dict[str, str]):
        self.custom_metadata_map = meta


class OpenVinoSession:
    """An IR compiled by OpenVINO, answering ONNX Runtime's `InferenceSession` calls that the
    check and the runtime model make: `run(None, feed)`, `get_inputs()`, `get_outputs()`,
    `get_modelmeta().custom_metadata_map` (the sidecar's keys, JSON text)."""

    def __init__(self, path: Path, device: str = "CPU"):
        ov = _openvino()
        core = ov.Core()
        if device not in core.available_devices:
            device = "CPU"
        self.compiled = core.compile_model(str(path), device, {"INFERENCE_PRECISION_HINT": "f32"})
        self.device = device
        sidecar = Path(path).with_suffix(".json")
        raw = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
        self.meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}

    def run(self, names, feed: dict[str, Any]) -> list:
        result = self.compiled(feed)
        return self._without_phantoms([result[port] for port in self.compiled.outputs])

    def _without_phantoms(self, got: list) -> list:
        """A detector's outputs less the rows OpenVINO makes up: where a two-stage detector finds
        nothing on an image, its run of the graph returns one row of label 0, score 0 and a box of
        round-off in place of none (ONNX Runtime and PyTorch: none). A row whose label is none of
        the model's (the `labels` metadata; without it, label 0 with score 0: torchvision's
        detectors never label a box 0, the background, and a kept score is above 0) is dropped."""
        names = [port.get_any_name() for port in self.compiled.outputs]
        if "detections" not in names:
            return got
        out = dict(zip(names, got))
        known = [int(k) for k in json.loads(self.meta["labels"])] if "labels" in self.meta else []
        counts, copied = np.array(out["detections"]), set[str]()
        for i, n in enumerate(counts):
            labels, scores = out["labels"][i][:n], out["scores"][i][:n]
            real = np.isin(labels, known) if known else (labels != 0) | (scores != 0)
            if real.all():
                continue
            for key in ("boxes", "labels", "scores", "masks"):
                if key in out:
                    if key not in copied:  # a writable copy, where a row goes
                        out[key], copied = np.array(out[key]), copied | {key}
                    rows = out[key][i][:n][real]
                    out[key][i] = 0
                    out[key][i][: len(rows)] = rows
            counts[i] = int(real.sum())
        out["detections"] = counts
        return [out[name] for name in names]

    def get_inputs(self) -> list[_Output]:
        return [_Output(port.get_any_name()) for port in self.compiled.inputs]

    def get_outputs(self) -> list[_Output]:
        return [_Output(port.get_any_name()) for port in self.compiled.outputs]

    def get_modelmeta(self) -> _Meta:
        return _Meta(self.meta)
