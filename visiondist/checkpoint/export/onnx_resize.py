"""The resize of a traced torchvision detector made the eager one: the same output size for every
input size.

torchvision's `GeneralizedRCNNTransform` scales an image by min(min_size / short side, max_size /
long side) and takes floor(side * scale) pixels. Eagerly that is Python's double arithmetic. Traced
for ONNX, `min_size / side` is recorded as `reciprocal(side) * min_size` in float32, and the floor
lands a pixel off the eager size for some sizes: at 800 / 1333, 28 of the 401 heights 240..640 of a
640-px-wide photo (385 x 640: 800 rows in the graph, 799 in PyTorch), so the exported graph sees
other pixels than PyTorch and finds slightly other boxes. `exact_resize` swaps in, for the trace
only, a resize that computes the scale and the output size in float64 with a true division, as the
eager code does, and passes the size (the sampling then uses input / output, as
`recompute_scale_factor=True` does eagerly).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor
from torchvision.models.detection import transform as tv_transform

log = logging.getLogger(__name__)


def _traced_resize(
    image: Tensor,
    self_min_size: float,
    self_max_size: float,
    target: Optional[dict[str, Tensor]] = None,
    fixed_size: Optional[tuple[int, int]] = None,
    *,
    original=None,
):
    """torchvision's `_resize_image_and_masks` where it is traced without targets or a fixed size;
    the original otherwise."""
    if not torch.jit.is_tracing() or target is not None or fixed_size is not None:
        return original(image, self_min_size, self_max_size, target, fixed_size)
    shape = torch._shape_as_tensor(image)[-2:].to(torch.float64)
    # 1-d tensors throughout: the exporter computes 0-d ones (Python numbers) in float32
    limits = torch.tensor([float(self_min_size), float(self_max_size)], dtype=torch.float64)
    scale = (
        torch.div(limits, torch.stack([shape.min(), shape.max()])).min(dim=0, keepdim=True).values
    )
    size = torch.floor(shape * scale).to(torch.int64)
    resized = F.interpolate(
        image[None],
        size=(size[0], size[1]),  # type: ignore[arg-type]  # tensors: the size stays traced
        mode="bilinear",
        align_corners=False,
    )
    return resized[0], target


@contextlib.contextmanager
def exact_resize() -> Iterator[None]:
    """Context: torchvision detectors traced inside resize their input to the sizes the eager model
    does."""
    original = getattr(tv_transform, "_resize_image_and_masks", None)
    # another torchvision: its own trace, which may resize some sizes a pixel off
    if original is None:
        log.warning(
            "torchvision %s has no transform._resize_image_and_masks: the ONNX graph resizes as "
            "torchvision traces it (a pixel off PyTorch's size for some image sizes)",
            torchvision.__version__,
        )
        yield
        return

    def resize(*args, **kwargs):
        return _traced_resize(*args, **kwargs, original=original)

    tv_transform._resize_image_and_masks = resize
    try:
        yield
    finally:
        tv_transform._resize_image_and_masks = original
