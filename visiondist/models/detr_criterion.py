"""The training loss of the DETR-class detectors (RT-DETRv2, D-FINE, RF-DETR / LW-DETR), built once
for the three families and batched for the device.

Every set of predictions a family supervises is a `Head`: a decoder layer, D-FINE's pre-decoder
boxes, the encoder's top-k proposals, a denoising layer (RT-DETR, D-FINE) or a layer's query groups
(RF-DETR's 13 in training). The step:

1. Each head that is matched gets its Hungarian cost matrix (focal class cost, L1 and GIoU of the
   boxes, the weights of the model's configuration) on the device, for every image at once (targets
   padded to the batch's most).
2. All of them go to the host in **one** transfer, the step's only host synchronisation; scipy's
   `linear_sum_assignment` solves each (image, group) there. Denoising queries are assigned by
   construction (query `g * 2 * max_gt + j` denoises target `j` in group `g`), D-FINE's GO-LSD union
   of every layer's matches is taken on the host as well.
3. Every index comes back in one host-to-device copy (pinned, asynchronous); the losses run on the
   device without a `.item()`, `torch.equal`, `.any()` or boolean-mask indexing: the normalisation
   by the batch's boxes (averaged over data-parallel ranks, as the original implementations do) is a
   device tensor, masked means are sums over counts.

The losses are the papers' and the original code's:
- RT-DETRv2 (lyuwenyu/RT-DETR `rtdetrv2_criterion.py`): varifocal classification, L1 and GIoU boxes,
  for the last layer, every other layer and the encoder proposals each with its own matching, the
  denoising groups with theirs. transformers' `RTDetrLoss` computes the same (tested equal on the
  same outputs).
- D-FINE (Peterande/D-FINE `dfine_criterion.py`): as RT-DETR for the classification; the box and
  fine-grained localisation (FGL) terms of every layer use the union of all layers' matches
  (GO-LSD), normalised by its size; the decoupled distillation focal (DDF) term distils the last
  layer's corner distributions into every earlier layer, positives and negatives weighted by the
  square roots of their counts; the pre-decoder boxes and the denoising layers as the original
  supervises them. transformers' `DFineLoss` differs (each layer's own matching, its aux layers
  paired with the next layer's corners, no FGL on the last layer), so the test checks this one
  against a direct transcription of the original's equations.
- RF-DETR / LW-DETR (roboflow/rf-detr, Apache-2.0): IoU-aware BCE classification, L1 and GIoU boxes,
  each query group matched on its own, for the last layer, every other layer and the encoder
  proposals; normalised by the boxes times the groups. transformers' `LwDetrImageLoss` computes the
  same (tested equal).

The terms themselves are `models/detr_losses.py`'s. `install(model)` makes a transformers
`...ForObjectDetection` use it: its forward calls `model.loss_function` with the raw outputs, so the
model runs unchanged and only the loss is ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

import visiondist.models.detr_matching as detr_matching
from visiondist.models.detr_boxes import box_iou, generalized_box_iou, xyxy
from visiondist.models.detr_losses import (
    decoupled_distillation,
    fine_grained_localisation,
    iou_aware_bce,
    varifocal,
)
from visiondist.models.detr_matching import assign_batched, go_union


@dataclass
class Head:
    """One set of predictions and how it is supervised."""

    name: str
    logits: Tensor  # (B, Q, C)
    boxes: Tensor  # (B, Q, 4): cx, cy, w, h relative to the image
    match: str = "own"  # "own": Hungarian on this head; "dn": denoising (assigned by construction)
    box_match: str = "own"  # the matching the box terms use: "own", "go" (D-FINE's union), "dn"
    groups: int = 1  # query groups matched apart (RF-DETR in training)
    corners: Optional[Tensor] = None  # D-FINE: (B, Q, 4 * (bins + 1)) edge distributions
    # D-FINE: (B, Q, 4) the reference boxes the corners are measured from
    refs: Optional[Tensor] = None
    # D-FINE: the last layer's (corners, logits) to distil from
    teacher: Optional[tuple[Tensor, Tensor]] = None
    # filled in: matching name -> (batch, query, target) index tensors
    matched: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# the criterion
class DetrCriterion:
    """The loss of one family (`rt_detr`, `d_fine`, `lw_detr`) with the weights of the model's
    configuration; called by the transformers model's forward as its `loss_function` (see
    `install`)."""

    def __init__(self, family: str, config: Any):
        if family not in ("rt_detr", "d_fine", "lw_detr"):
            raise ValueError(f"no DETR criterion for {family!r}: rt_detr, d_fine or lw_detr")
        self.family, self.config = family, config
        c = config
        if family == "lw_detr":
            self.cost = (float(c.class_cost), float(c.bbox_cost), float(c.giou_cost), 0.25, 2.0)
            self.weights = {
                "class": float(c.class_loss_coefficient),
                "bbox": float(c.bbox_loss_coefficient),
                "giou": float(c.giou_loss_coefficient),
            }
            self.alpha, self.gamma = float(c.focal_alpha), 2.0
        else:
            self.cost = (
                float(c.matcher_class_cost),
                float(c.matcher_bbox_cost),
                float(c.matcher_giou_cost),
                float(c.matcher_alpha),
                float(c.matcher_gamma),
            )
            self.weights = {
                "class": float(c.weight_loss_vfl),
                "bbox": float(c.weight_loss_bbox),
                "giou": float(c.weight_loss_giou),
            }
            if family == "d_fine":
                self.weights.update(fgl=float(c.weight_loss_fgl), ddf=float(c.weight_loss_ddf))
            self.alpha, self.gamma = float(c.focal_loss_alpha), float(c.focal_loss_gamma)
        # the host's share of the steps so far: waiting for the cost matrices (the forward before
        # them, on a GPU), then solving them (scipy) and building the indices; what the benchmark
        # reports beside the step
        self.host_seconds = {"wait": 0.0, "solve": 0.0}
        self.calls = 0

    # the model's forward calls this with its raw outputs; a compiled model runs it eagerly (the
    # host's matching)
    @torch.compiler.disable
    def __call__(
        self,
        logits,
        labels,
        device,
        pred_boxes,
        config,
        outputs_class=None,
        outputs_coord=None,
        *args,
        **kwargs,
    ):
        heads = (
            self._lw_heads(logits, pred_boxes, outputs_class, outputs_coord, *args[:2], **kwargs)
            if self.family == "lw_detr"
            else self._rt_heads(outputs_class, outputs_coord, *args, **kwargs)
        )
        terms = self.losses(heads, labels, kwargs.get("denoising_meta_values"))
        total = sum(terms.values())
        return total, terms, None

    # -------------------------------------------------------------------------------------------
    # the families' heads
    def _rt_heads(
        self,
        outputs_class,
        outputs_coord,
        enc_topk_logits=None,
        enc_topk_bboxes=None,
        denoising_meta_values=None,
        predicted_corners=None,
        initial_reference_points=None,
        **_,
    ):
        """RT-DETR and D-FINE: (B, layers, queries, ...) stacks; denoising queries first where there
        are any."""
        meta = denoising_meta_values
        split = list(meta["dn_num_split"]) if meta is not None else None

        def parts(t):
            return torch.split(t, split, dim=2) if split else (None, t)

        dn_class, out_class = parts(outputs_class)
        dn_coord, out_coord = parts(outputs_coord)
        aux = bool(self.config.auxiliary_loss)
        heads: list[Head] = []
        if self.family == "rt_detr":
            layers = out_class.shape[1]
            heads.append(Head("last", out_class[:, -1], out_coord[:, -1]))
            if aux:
                heads += [
                    Head(f"layer{i}", out_class[:, i], out_coord[:, i]) for i in range(layers - 1)
                ]
                heads.append(Head("enc", enc_topk_logits, enc_topk_bboxes))
                if meta is not None:
                    heads += [
                        Head(f"dn{i}", dn_class[:, i], dn_coord[:, i], match="dn", box_match="dn")
                        for i in range(layers)
                    ]
            return heads
        # D-FINE: logits / boxes hold the pre-decoder prediction first, then one per layer; corners
        # and reference points one per layer
        dn_corners, out_corners = parts(predicted_corners)
        dn_refs, out_refs = parts(initial_reference_points)
        layers = out_corners.shape[1]

        def layer_heads(cls, coord, corners, refs, prefix, match):
            box = "dn" if match == "dn" else "go"
            teacher = (corners[:, -1], cls[:, -1])
            hs = [
                Head(
                    f"{prefix}last",
                    cls[:, -1],
                    coord[:, -1],
                    match,
                    box,
                    corners=corners[:, -1],
                    refs=refs[:, -1],
                )
            ]
            if aux:
                hs += [
                    Head(
                        f"{prefix}layer{i}",
                        cls[:, i + 1],
                        coord[:, i + 1],
                        match,
                        box,
                        corners=corners[:, i],
                        refs=refs[:, i],
                        teacher=teacher,
                    )
                    for i in range(layers - 1)
                ]
                hs.append(Head(f"{prefix}pre", cls[:, 0], coord[:, 0], match, box))
            return hs

        heads = layer_heads(out_class, out_coord, out_corners, out_refs, "", "own")
        if aux:
            heads.append(Head("enc", enc_topk_logits, enc_topk_bboxes, box_match="go"))
            if meta is not None:
                heads += layer_heads(dn_class, dn_coord, dn_corners, dn_refs, "dn_", "dn")
        if not aux:  # one layer's terms: its own matching
            heads[0].box_match = "own"
        return heads

    def _lw_heads(
        self, logits, pred_boxes, outputs_class, outputs_coord, enc_class=None, enc_coord=None, **_
    ):
        queries = int(self.config.num_queries)
        groups = logits.shape[1] // queries if logits.shape[1] % queries == 0 else 1
        heads = [Head("last", logits, pred_boxes, groups=groups)]
        if self.config.auxiliary_loss and outputs_class is not None:
            heads += [
                Head(f"layer{i}", outputs_class[i], outputs_coord[i], groups=groups)
                for i in range(outputs_class.shape[0] - 1)
            ]
        if enc_class is not None:
            heads.append(Head("enc", enc_class, enc_coord, groups=groups))
        return heads

    # ----------------------------------------------------------------------------------------------
    # the cost
    @torch.no_grad()
    def cost_matrix(self, head: Head, labels: Tensor, boxes: Tensor) -> Tensor:
        """(B * groups, Q / groups, T) costs of `head` against the padded targets (labels (B, T),
        boxes (B, T, 4))."""
        w_class, w_bbox, w_giou, alpha, gamma = self.cost
        logits, pred = head.logits.float(), head.boxes.float()
        b, q, _ = logits.shape
        t = labels.shape[1]
        prob = logits.sigmoid().gather(2, labels[:, None, :].expand(b, q, t))
        neg = (1 - alpha) * prob**gamma * -(1 - prob + 1e-8).log()
        pos = alpha * (1 - prob) ** gamma * -(prob + 1e-8).log()
        l1 = torch.cdist(pred, boxes.float(), p=1)
        giou = generalized_box_iou(xyxy(pred)[:, :, None], xyxy(boxes.float())[:, None])
        cost = w_bbox * l1 + w_class * (pos - neg) - w_giou * giou
        big = torch.finfo(cost.dtype).max
        cost = torch.nan_to_num(cost, nan=big, posinf=big, neginf=big)
        g = head.groups
        return cost.view(b, g, q // g, t).reshape(b * g, q // g, t)

    def match(self, heads: list[Head], labels: list[dict], meta: Optional[dict] = None) -> dict:
        """Fill each head's `matched` with (batch, query, flat target) index tensors: the Hungarian
        matchings (one transfer to the host for all of them), the denoising assignment and D-FINE's
        union. Returns the host-known counts the losses normalise by."""
        counts = [int(t["class_labels"].shape[0]) for t in labels]
        device = heads[0].logits.device
        most = max(counts) if counts else 0
        own = [h for h in heads if h.match == "own"]
        solved: list = [[] for _ in own]
        self.calls += 1
        if most > 0 and own:
            pad_labels = torch.zeros(len(counts), most, dtype=torch.long, device=device)
            pad_boxes = torch.full((len(counts), most, 4), 0.5, device=device)
            for i, t in enumerate(labels):
                pad_labels[i, : counts[i]] = t["class_labels"]
                pad_boxes[i, : counts[i]] = t["boxes"].float()
            solved = assign_batched(
                [self.cost_matrix(h, pad_labels, pad_boxes) for h in own], counts, self.host_seconds
            )
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # (head, kind) -> per image pairs
        host: dict[tuple[int, str], list[tuple[np.ndarray, np.ndarray]]] = {}
        for h, problems in zip(own, solved):
            per_image = []
            for b in range(len(counts)):
                rows, cols = [], []
                for g in range(h.groups):
                    r, c = problems[b * h.groups + g] if problems else (np.zeros(0, np.int64),) * 2
                    rows.append(r + g * (h.logits.shape[1] // h.groups))
                    cols.append(c)
                per_image.append((np.concatenate(rows), np.concatenate(cols)))
            host[(id(h), "own")] = per_image
        uses_go = any(h.box_match == "go" for h in heads)
        if uses_go:
            go = [go_union([host[(id(h), "own")][b] for h in own]) for b in range(len(counts))]
        if meta is not None:
            groups = int(meta["dn_num_group"])
            dn = [
                (
                    np.array([g * 2 * most + j for g in range(groups) for j in range(n)], np.int64),
                    np.tile(np.arange(n, dtype=np.int64), groups),
                )
                for n in counts
            ]
        # every index array as one vector: one copy to the device
        plan, chunks = [], []
        for h in heads:
            for kind in dict.fromkeys((h.match, h.box_match)):
                pairs = host[(id(h), "own")] if kind == "own" else go if kind == "go" else dn
                batch = np.concatenate(
                    [np.full(len(r), b, np.int64) for b, (r, _) in enumerate(pairs)]
                )
                query = np.concatenate([r for r, _ in pairs])
                target = np.concatenate([c + offsets[b] for b, (_, c) in enumerate(pairs)])
                plan.append((h, kind, len(batch)))
                chunks += [batch, query, target]
        flat = detr_matching.to_device(
            np.concatenate(chunks) if chunks else np.zeros(0, np.int64), device
        )
        start = 0
        for h, kind, n in plan:
            h.matched[kind] = (
                flat[start : start + n],
                flat[start + n : start + 2 * n],
                flat[start + 2 * n : start + 3 * n],
            )
            start += 3 * n
        return {
            "boxes": sum(counts),
            "go": sum(len(r) for r, _ in go) if uses_go else 0,
            "dn_groups": int(meta["dn_num_group"]) if meta is not None else 1,
        }

    # ----------------------------------------------------------------------------------------------
    # the losses
    def losses(
        self, heads: list[Head], labels: list[dict], meta: Optional[dict] = None
    ) -> dict[str, Tensor]:
        """The weighted terms of every head; `meta`: the model's denoising values (RT-DETR, D-FINE
        in training)."""
        stats = self.match(heads, labels, meta)
        device = heads[0].logits.device
        target_labels = (
            torch.cat([t["class_labels"] for t in labels])
            if labels
            else torch.zeros(0, dtype=torch.long, device=device)
        )
        target_boxes = (
            torch.cat([t["boxes"] for t in labels]).float()
            if labels
            else torch.zeros(0, 4, device=device)
        )
        groups = max(h.groups for h in heads)
        num, num_go = _normalisers(float(stats["boxes"] * groups), float(stats["go"]), device)
        terms: dict[str, Tensor] = {}
        ddf_split = None
        # DDF's positive / negative weights: the last layer's union matching's counts
        if self.family == "d_fine":
            first = heads[0]
            positives = 4 * stats["go"]
            negatives = 4 * first.logits.shape[0] * first.logits.shape[1] - positives
            rp, rn = math.sqrt(positives), math.sqrt(max(negatives, 0))
            ddf_split = (rp / (rp + rn), rn / (rp + rn)) if rp + rn > 0 else (0.0, 0.0)
        for h in heads:
            dn = h.match == "dn"
            n_class = num * stats["dn_groups"] if dn else num
            n_box = num * stats["dn_groups"] if dn else (num_go if h.box_match == "go" else num)
            b, q, t = h.matched[h.match]
            targets = (target_labels, target_boxes)
            classified = (
                iou_aware_bce(h.logits, h.boxes, (b, q, t), targets, n_class, self.alpha)
                if self.family == "lw_detr"
                else varifocal(
                    h.logits, h.boxes, (b, q, t), targets, n_class, self.alpha, self.gamma
                )
            )
            terms[f"class_{h.name}"] = self.weights["class"] * classified
            b, q, t = h.matched[h.box_match]
            pred, tgt = h.boxes[b, q].float(), target_boxes[t]
            terms[f"bbox_{h.name}"] = self.weights["bbox"] * (pred - tgt).abs().sum() / n_box
            giou = generalized_box_iou(xyxy(pred), xyxy(tgt))
            terms[f"giou_{h.name}"] = self.weights["giou"] * (1 - giou).sum() / n_box
            if h.corners is not None and h.refs is not None:  # D-FINE's heads: set together
                iou = box_iou(xyxy(pred), xyxy(tgt)).detach()
                terms[f"fgl_{h.name}"] = self.weights["fgl"] * fine_grained_localisation(
                    h.corners, h.refs, (b, q), tgt, iou, n_box, self.config
                )
                if h.teacher is not None:
                    terms[f"ddf_{h.name}"] = self.weights["ddf"] * decoupled_distillation(
                        h.corners, h.teacher, (b, q), iou, ddf_split, int(self.config.max_num_bins)
                    )
        return terms


def _normalisers(boxes: float, go: float, device: torch.device) -> tuple[Any, Any]:
    """The boxes (and D-FINE's union matches) averaged over data-parallel ranks, at least 1: a
    device tensor under torch.distributed (one all-reduce, no host read), plain numbers in one
    process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        both = torch.tensor([boxes, go], device=device)
        dist.all_reduce(both)
        both = (both / dist.get_world_size()).clamp(min=1.0)
        return both[0], both[1]
    return max(boxes, 1.0), max(go, 1.0)


FAMILIES = {
    "rt_detr": "rt_detr",
    "rt_detr_v2": "rt_detr",
    "d_fine": "d_fine",
    "rf_detr": "lw_detr",
    "lw_detr": "lw_detr",
}


def install(model) -> Optional[DetrCriterion]:
    """Make a transformers DETR-class `...ForObjectDetection` train with this criterion (its forward
    calls `loss_function` with the raw outputs); None for a model of no family here."""
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None) or "")
    if family is None:
        return None
    criterion = DetrCriterion(family, model.config)
    model.loss_function = criterion
    return criterion
