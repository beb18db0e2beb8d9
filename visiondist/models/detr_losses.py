"""The classification and localisation terms of the DETR-class losses (`models/detr_criterion.py`
matches the queries and weighs the terms): RT-DETR's and D-FINE's varifocal loss, LW-DETR's
IoU-aware BCE, and D-FINE's fine-grained localisation (FGL) and decoupled distillation focal (DDF)
terms. Each takes the matched (image, query, target) indices and a normaliser, and reads nothing on
the host."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from visiondist.models.detr_boxes import box_iou, edge_targets, xyxy


def varifocal(
    logits: Tensor, boxes: Tensor, matched: tuple, targets: tuple, num, alpha: float, gamma: float
) -> Tensor:
    """Varifocal loss: BCE towards the IoU at the matched (query, class), focal-weighted elsewhere.
    `matched`: (image, query, target) indices; `targets`: (labels, boxes) of the batch."""
    b, q, t = matched
    target_labels, target_boxes = targets
    logits = logits.float()
    iou = box_iou(xyxy(boxes[b, q].detach().float()), xyxy(target_boxes[t]))
    cls = target_labels[t]
    score = torch.zeros_like(logits).index_put((b, q, cls), iou)
    positive = torch.zeros_like(logits).index_put((b, q, cls), torch.ones_like(iou))
    weight = alpha * logits.detach().sigmoid().pow(gamma) * (1 - positive) + score
    return F.binary_cross_entropy_with_logits(logits, score, weight=weight, reduction="sum") / num


def iou_aware_bce(
    logits: Tensor, boxes: Tensor, matched: tuple, targets: tuple, num, alpha: float
) -> Tensor:
    """LW-DETR's IoU-aware BCE: positives towards prob^alpha * IoU^(1 - alpha) (at least 0.01),
    negatives weighted by prob^2."""
    b, q, t = matched
    target_labels, target_boxes = targets
    logits = logits.float()
    prob = logits.sigmoid()
    iou = box_iou(xyxy(boxes[b, q].detach().float()), xyxy(target_boxes[t]))
    where = (b, q, target_labels[t])
    quality = (prob[where].detach().pow(alpha) * iou.pow(1 - alpha)).clamp(min=0.01)
    positive = torch.zeros_like(logits, dtype=torch.bool).index_put(
        where, torch.ones_like(iou, dtype=torch.bool)
    )
    pos_w = torch.zeros_like(logits).index_put(where, quality)
    neg_w = torch.where(positive, 1 - pos_w, prob.pow(2))
    loss = -pos_w * F.logsigmoid(logits) - neg_w * F.logsigmoid(-logits)
    return loss.sum() / num


def fine_grained_localisation(
    corners: Tensor, refs: Tensor, matched: tuple, target: Tensor, iou: Tensor, num, config
) -> Tensor:
    """D-FINE's FGL: each edge's distribution towards the two bins around the target distance,
    IoU-weighted (`config`: the model's `max_num_bins`, `reg_scale`, `up`)."""
    b, q = matched
    bins = int(config.max_num_bins)
    pred = corners[b, q].float().reshape(-1, bins + 1)
    with torch.no_grad():
        left, w_right, w_left = edge_targets(
            refs[b, q].detach().float(),
            xyxy(target),
            bins,
            float(config.reg_scale),
            float(config.up),
        )
    left_bin = left.long()
    loss = (
        F.cross_entropy(pred, left_bin, reduction="none") * w_left
        + F.cross_entropy(pred, left_bin + 1, reduction="none") * w_right
    )
    return (loss * iou.repeat_interleave(4)).sum() / num


def decoupled_distillation(
    corners: Tensor,
    teacher: tuple[Tensor, Tensor],
    matched: tuple,
    iou: Tensor,
    split,
    bins: int,
    temperature: float = 5.0,
) -> Tensor:
    """D-FINE's DDF: the last layer's edge distributions distilled into this one, weighted by the
    teacher's confidence (the IoU at matched queries), matched and unmatched averaged apart and
    weighed by `split` (positive, negative)."""
    b, q = matched
    teacher_corners, teacher_logits = teacher
    pred = corners.float().reshape(-1, bins + 1)
    target = teacher_corners.detach().float().reshape(-1, bins + 1)
    weight = teacher_logits.detach().float().sigmoid().max(dim=-1).values
    weight = weight.index_put((b, q), iou)
    hit = torch.zeros_like(weight).index_put((b, q), torch.ones_like(iou))
    weight = weight.repeat_interleave(4, dim=-1).reshape(-1)
    hit = hit.repeat_interleave(4, dim=-1).reshape(-1)
    kl = F.kl_div(
        F.log_softmax(pred / temperature, dim=1),
        F.softmax(target / temperature, dim=1),
        reduction="none",
    ).sum(-1)
    loss = weight * temperature**2 * kl
    pos = (loss * hit).sum() / hit.sum().clamp(min=1)
    neg = (loss * (1 - hit)).sum() / (1 - hit).sum().clamp(min=1)
    return pos * split[0] + neg * split[1]
