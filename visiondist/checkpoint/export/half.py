"""half=true of format=onnx: the network's layers in float16, what turns its outputs into boxes in
float32. A copy of the model whose network parts (`NETWORK`: a ViT whole; a detector's backbone and
feature pyramid, its heads' layers; a DETR-class model's transformers network) are wrapped by
`Half`: their weights stored and their arithmetic done in float16, their inputs and outputs cast at
the wrapper, so that the graph's inputs and outputs stay float32 and box decoding, NMS, RoIAlign's
sampling and the scaling to pixels keep float32's precision (a 1333-px coordinate in float16 is
0.5 px coarse). The graph is traced from that copy as the float32 one is (`onnx.py`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

# family -> the dotted names of its network parts (those absent from a model are skipped)
NETWORK = {
    "vit": [""],
    "torchvision": [
        "backbone",
        "rpn.head",
        "roi_heads.box_head",
        "roi_heads.box_predictor",
        "roi_heads.mask_head",
        "roi_heads.mask_predictor",
        "head",
    ],
    "detr": ["model"],
}
NETWORK["vitdet"] = NETWORK["torchvision"]


class Half(nn.Module):
    """`inner` in float16: float32 tensors in its inputs cast to float16, float16 tensors in its
    outputs (tensors, lists, tuples, dicts, transformers' ModelOutput) cast back to float32."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner.half()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _cast((args, kwargs), torch.float32, torch.float16)
        return _cast(self.inner(*args, **kwargs), torch.float16, torch.float32)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # what the code around the part reads of it (out_channels, ...)
            return getattr(super().__getattr__("inner"), name)


class HalfClassifier(Half):
    """A classifier in float16 with the one named input an export's dynamic shapes name
    (`images`)."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return super().forward(images)


def _cast(value: Any, src: torch.dtype, dst: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dst) if value.dtype == src else value
    if isinstance(value, dict):
        if hasattr(value, "to_tuple"):  # a transformers ModelOutput: set in place, type kept
            for key in list(value.keys()):
                value[key] = _cast(value[key], src, dst)
            return value
        return type(value)((k, _cast(v, src, dst)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_cast(v, src, dst) for v in value)
    return value


def halved(model: nn.Module, family: str) -> nn.Module:
    """A copy of `model` with its network parts (`NETWORK[family]`) in float16 (`Half`); the model
    itself is not changed."""
    if family not in NETWORK:
        raise ValueError(f"half=true is not supported for model.family={family}")
    copied = copy.deepcopy(model)
    parts = [name for name in NETWORK[family] if name == "" or _has(copied, name)]
    if parts == [""]:
        return HalfClassifier(copied)
    for name in parts:
        parent_name, _, leaf = name.rpartition(".")
        parent = copied.get_submodule(parent_name) if parent_name else copied
        part = getattr(parent, leaf)
        if isinstance(part, nn.Module):
            setattr(parent, leaf, Half(part))
    return copied


def _has(model: nn.Module, name: str) -> bool:
    try:
        return model.get_submodule(name) is not None
    except AttributeError:
        return False
