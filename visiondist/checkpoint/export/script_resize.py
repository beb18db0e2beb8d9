"""The resize of a scripted torchvision detector made the eager one: the same output size for every
input size (`exact_script_resize`).

Scripted, torchvision's `_resize_image_and_masks` computes the scale as a float32 tensor and lets
`interpolate` derive the size from it, which lands a pixel short of the eager size for some sizes
(a 200 x 200 image at min_size 240: 239 rows scripted, 240 eagerly), so the file finds other boxes
than PyTorch there (4 px apart on a trained Faster R-CNN). The replacement scripted in its place
computes the scale and the output size in double precision, as the eager code does, and passes the
size; training's call (with targets or a fixed size) goes to torchvision's own. No `from __future__
import annotations` here: TorchScript reads the annotations as written."""

import contextlib
import math
from typing import Iterator, Optional

import torch.nn.functional as F
from torch import Tensor
from torchvision.models.detection import transform as tv_transform

# torchvision 0.26 and later have it (the supported torch releases' torchvision)
_TORCHVISION_RESIZE = tv_transform._resize_image_and_masks


def _eager_sized_resize(
    image: Tensor,
    self_min_size: int,
    self_max_size: int,
    target: Optional[dict[str, Tensor]] = None,
    fixed_size: Optional[tuple[int, int]] = None,
) -> tuple[Tensor, Optional[dict[str, Tensor]]]:
    if target is not None or fixed_size is not None:
        return _TORCHVISION_RESIZE(image, self_min_size, self_max_size, target, fixed_size)
    height, width = float(image.shape[-2]), float(image.shape[-1])
    short, long = min(height, width), max(height, width)
    scale = min(float(self_min_size) / short, float(self_max_size) / long)
    size = [int(math.floor(height * scale)), int(math.floor(width * scale))]
    return F.interpolate(image[None], size=size, mode="bilinear", align_corners=False)[0], target


@contextlib.contextmanager
def exact_script_resize() -> Iterator[None]:
    """Context: a torchvision detector scripted inside resizes its input to the sizes the eager
    model does."""
    tv_transform._resize_image_and_masks = _eager_sized_resize
    try:
        yield
    finally:
        tv_transform._resize_image_and_masks = _TORCHVISION_RESIZE
