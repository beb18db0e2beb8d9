"""A traced torchvision two-stage detector that runs on an image where its RPN proposes no box.

torchvision's `BoxCoder.decode` reshapes the box regression to `(proposals, -1)` and the decoded
boxes to `(proposals, -1, 4)`. Eagerly a reshape of zero rows is fine. In an ONNX graph the `-1` of
a shape whose other sizes multiply to 0 cannot be inferred, and ONNX Runtime fails there (`Input
shape:{0,28}, requested shape:{0,-1}`; OpenVINO returns a made-up row, which `OpenVinoSession`
drops). That happens wherever the RPN's score threshold (0.05 for torchvision's MobileNet Faster
R-CNN) leaves no proposal, which a model early in training meets on ordinary images (7% of a
226-step model's val images). `empty_safe_decode` swaps in, for the trace only, a decode whose
reshapes name every size (the regression's width / 4 boxes a row), so that the graph returns no
detections there, as PyTorch does.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor
from torchvision.models.detection import _utils as det_utils


def _decode(coder, rel_codes: Tensor, boxes: list[Tensor]) -> Tensor:
    """`BoxCoder.decode` with explicit sizes: (proposals, classes, 4) from (proposals, classes x
    4) codes, zero proposals included."""
    concat_boxes = torch.cat(boxes, dim=0)
    rows = concat_boxes.shape[0]
    rel_codes = rel_codes.reshape(rows, rel_codes.shape[-1])
    pred_boxes = coder.decode_single(rel_codes, concat_boxes)
    return pred_boxes.reshape(rows, pred_boxes.shape[-1] // 4, 4)


@contextlib.contextmanager
def empty_safe_decode() -> Iterator[None]:
    """Context: torchvision's box decoding traced inside holds for zero proposals (module doc)."""
    original = det_utils.BoxCoder.decode

    def decode(self, rel_codes: Tensor, boxes: list[Tensor]) -> Tensor:
        if not torch.jit.is_tracing():
            return original(self, rel_codes, boxes)
        return _decode(self, rel_codes, boxes)

    det_utils.BoxCoder.decode = decode
    try:
        yield
    finally:
        det_utils.BoxCoder.decode = original
