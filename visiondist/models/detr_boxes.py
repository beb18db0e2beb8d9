"""The box geometry of the DETR-class criterion (`detr_criterion.py`): (cx, cy, w, h) boxes as
corners, IoU and GIoU broadcast over pairs or all pairs, and D-FINE's distance targets of each box
edge on its non-uniform bins; written without boolean-mask indexing, so that nothing reads the
device."""

from __future__ import annotations

import torch
from torch import Tensor


def xyxy(boxes: Tensor) -> Tensor:
    """(cx, cy, w, h) boxes as (x1, y1, x2, y2)."""
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)


def _iou_parts(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(intersection, union, enclosing area) of corner boxes, broadcast against each other."""
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    lt, rb = torch.maximum(a[..., :2], b[..., :2]), torch.minimum(a[..., 2:], b[..., 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    union = area_a + area_b - inter
    hull = (
        (torch.maximum(a[..., 2:], b[..., 2:]) - torch.minimum(a[..., :2], b[..., :2]))
        .clamp(min=0)
        .prod(-1)
    )
    return inter, union, hull


def box_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU of corner boxes `a` and `b`, broadcast (pairs: equal shapes; all pairs: a[:, :, None],
    b[:, None])."""
    inter, union, _ = _iou_parts(a, b)
    return inter / union


def generalized_box_iou(a: Tensor, b: Tensor) -> Tensor:
    """GIoU of corner boxes, broadcast as `box_iou`."""
    inter, union, hull = _iou_parts(a, b)
    return inter / union - (hull - union) / hull


def edge_targets(refs: Tensor, target: Tensor, bins: int, reg_scale: float, up: float):
    """D-FINE's distance targets of each box edge from its reference box (cx, cy, w, h) on the
    model's non-uniform bins: (left bin as a float, weight of the right bin, weight of the left
    bin), one per edge (4 per box) - `bbox2distance` / `translate_gt` of the original, written
    without boolean-mask indexing."""
    from transformers.loss.loss_d_fine import (  # noqa: PLC0415 (the optional extra [detr])
        weighting_function,
    )

    scale = abs(reg_scale)
    cx, cy, w, h = refs.unbind(-1)
    x1, y1, x2, y2 = target.unbind(-1)
    edges = (
        torch.stack(
            [
                (cx - x1) / (w / scale + 1e-16),
                (cy - y1) / (h / scale + 1e-16),
                (x2 - cx) / (w / scale + 1e-16),
                (y2 - cy) / (h / scale + 1e-16),
            ],
            -1,
        )
        - 0.5 * scale
    )
    edges = edges.reshape(-1)
    # transformers annotates reg_scale an int; D-FINE's configs hold a float (4.0), as it computes
    values = weighting_function(
        bins,
        torch.tensor([up], device=refs.device),
        reg_scale,  # type: ignore[arg-type]
    ).to(edges.dtype)
    index = (values[None] <= edges[:, None]).sum(1) - 1
    inside = index.clamp(0, bins - 1)
    left_d = (edges - values[inside]).abs()
    right_d = (values[inside + 1] - edges).abs()
    right = left_d / (left_d + right_d)
    below, above = index < 0, index >= bins
    w_right = torch.where(
        below, torch.zeros_like(right), torch.where(above, torch.ones_like(right), right)
    )
    w_left = torch.where(
        below, torch.ones_like(right), torch.where(above, torch.zeros_like(right), 1 - right)
    )
    left = torch.where(
        below,
        torch.zeros_like(edges),
        torch.where(above, torch.full_like(edges, bins - 0.1), index.to(edges.dtype)),
    )
    return left.clamp(0, bins - 0.1), w_right, w_left
