"""Exported files run by their own runtime where a prediction or an evaluation takes weights: an
ONNX graph (`tools/export.py format=onnx`) under ONNX Runtime, an OpenVINO IR (`format=openvino`)
under OpenVINO, a torch.export program (`format=pt2`) under torch. The loaded file answers as the
PyTorch model does (`RuntimeModel`): a classifier takes the normalised batch and gives logits, a
detector takes images (3, h, w), float in [0, 1], and gives each one's boxes, labels, scores (and
masks) in its pixels, so that `tools/predict.py` and `tools/eval.py` write for it the files they
write for the model it came from, and eval scores the file itself. `models/exported.py` says what a
file is and checks it against the model config.

A detector's graph is fed as its `input` metadata says (`onnx_batch.detector_feed`: resized to the
model's side, or the originals on one canvas), the whole batch in one call.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from visiondist.checkpoint.export.onnx_batch import run_detector
from visiondist.models.exported import check_runtime_file, runtime_of
from visiondist.models.registry import TASKS

log = logging.getLogger(__name__)


class RuntimeModel(nn.Module):
    """An exported file as the model a prediction or an evaluation calls (the module's docstring);
    eval mode only. `runtime` names what runs it."""

    def __init__(self, path: Path, task: str, device: torch.device):
        super().__init__()
        self.path, self.task, self.device = Path(path), task, device
        self.runtime = runtime_of(self.path) or "ONNX Runtime"
        self.program: Optional[nn.Module] = None
        self.session: Any = None
        self.failed = 0  # detector images the graph failed on (`_alone`)
        if self.runtime == "torch.export":
            self.program = torch.export.load(str(self.path)).module().to(device)
            return
        if self.runtime == "OpenVINO":
            from visiondist.checkpoint.export.openvino import OpenVinoSession  # noqa: PLC0415

            self.session = OpenVinoSession(self.path, "GPU" if device.type == "cuda" else "CPU")
        else:
            import onnxruntime as ort  # noqa: PLC0415 (onnxruntime: the export extra)

            providers = ["CPUExecutionProvider"]
            if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
                providers.insert(0, "CUDAExecutionProvider")
            options = ort.SessionOptions()
            options.log_severity_level = 3  # errors only: the graph's own notes are not the user's
            self.session = ort.InferenceSession(str(self.path), options, providers=providers)
        meta = self.session.get_modelmeta().custom_metadata_map
        self.given = json.loads(meta.get("input", "{}"))
        self.outputs = [o.name for o in self.session.get_outputs()]

    def train(self, mode: bool = True):
        """Eval mode only (a torch.export program has no train mode to switch: it is not
        recursed into)."""
        if mode:
            raise RuntimeError(f"{self.path} is an exported file: it evaluates and predicts only")
        self.training = False
        return self

    @torch.no_grad()
    def forward(self, images):
        if self.program is not None:
            return self.program(images)
        if self.task == "classification":
            logits = self.session.run(None, {"images": images.float().cpu().numpy()})[0]
            return torch.from_numpy(logits).to(images.device)
        device = images[0].device
        cpu = [im.float().cpu() for im in images]
        try:
            results = self._detect(cpu)
        except Exception:  # onnxruntime's own errors: one image of the batch, below
            results = [self._alone(image) for image in cpu]
        return [{k: v.to(device) for k, v in found.items()} for found in results]

    def _detect(self, images: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return run_detector(self.session, self.given, images)

    def _alone(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """One image's detections; none where the graph fails on it: a Faster R-CNN graph
        exported by an earlier visiondist (torchvision's own trace) fails on an image where the
        RPN proposes no box, where the PyTorch model returns none (counted in `self.failed`, said
        once)."""
        try:
            return self._detect([image])[0]
        except Exception as exc:
            self.failed += 1
            if self.failed == 1:
                log.warning(
                    "%s failed on a %d x %d image: no detections for it, as the PyTorch model "
                    "returns where its RPN proposes no box (a graph exported before the export "
                    "handled that: export it again); the runtime said: %s",
                    self.path,
                    image.shape[-2],
                    image.shape[-1],
                    str(exc).strip().splitlines()[-1][-160:],
                )
            found = {
                "boxes": torch.zeros(0, 4),
                "labels": torch.zeros(0, dtype=torch.int64),
                "scores": torch.zeros(0),
            }
            if "masks" in self.outputs:
                found["masks"] = torch.zeros(0, 1, *image.shape[-2:])
            return found


def load_runtime(model_cfg, path: Path, device: torch.device) -> RuntimeModel:
    """The exported file `path`, checked against `model_cfg` (`check_runtime_file`), ready to run
    on `device` (ONNX Runtime's CUDA provider where it has one, else its CPU)."""
    check_runtime_file(model_cfg, path)
    return RuntimeModel(path, TASKS[model_cfg.family], device).eval()
