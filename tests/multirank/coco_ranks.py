"""Rank-side code of the COCO evaluation tests: a stand-in detector whose predictions depend only on
the image, so any split of the val set over ranks must give the same detections and the same stats.
The ranks run on the test device (`devices`): the images reach the stand-in there, its answers come
back from there."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from devices import init_test_rank
from torch import nn
from torch.utils.data import DataLoader

from visiondist.data.coco import CocoDetection, collate_detection
from visiondist.data.sampler import EvalBatchSampler


def _key(image: torch.Tensor) -> str:
    """The image's pixels as the dataset yields them (uint8; the detector sees float in [0, 1],
    rounded back here: exact on any device, whichever way it divided by 255)."""
    if image.dtype != torch.uint8:
        image = image.mul(255).round().to(torch.uint8)
    return hashlib.sha1(image.cpu().numpy().tobytes()).hexdigest()


def fake_predictions(target: dict, num_classes: int) -> dict:
    """Ground truth jittered, some missed, some with the wrong class, plus false positives; seeded
    by image id. With the target's masks, also mask probabilities: each kept object's mask shifted
    by a pixel or two (probability 0.9 inside, 0.2 at the rim), a false positive's its box filled at
    0.7."""
    rng = np.random.default_rng(int(target["image_id"]))
    boxes, labels, scores = [], [], []
    gt_masks = target["masks"].numpy() if "masks" in target else None
    masks = []
    for k, (box, label) in enumerate(zip(target["boxes"].numpy(), target["labels"].numpy())):
        if rng.random() < 0.15:
            continue
        size = box[2:] - box[:2]
        jitter = rng.normal(0, 0.06, 4) * np.concatenate([size, size])
        boxes.append(box + jitter)
        labels.append(label if rng.random() < 0.9 else rng.integers(1, num_classes + 1))
        scores.append(rng.uniform(0.3, 1.0))
        if gt_masks is not None:
            shifted = np.roll(gt_masks[k], tuple(rng.integers(-2, 3, 2)), axis=(0, 1)).astype(
                np.float32
            )
            rim = np.roll(shifted, 1, axis=0) != shifted
            masks.append(np.where(rim, 0.2, 0.9 * shifted))
    for _ in range(rng.integers(0, 4)):
        x, y = rng.uniform(0, 100, 2)
        boxes.append([x, y, x + rng.uniform(5, 40), y + rng.uniform(5, 40)])
        labels.append(rng.integers(1, num_classes + 1))
        scores.append(rng.uniform(0.0, 0.5))
        if gt_masks is not None:
            fill = np.zeros(gt_masks.shape[1:], dtype=np.float32)
            x1, y1, x2, y2 = (int(v) for v in boxes[-1])
            fill[y1:y2, x1:x2] = 0.7
            masks.append(fill)
    out = {
        "boxes": torch.tensor(np.array(boxes, dtype=np.float32).reshape(-1, 4)),
        "labels": torch.tensor(np.array(labels, dtype=np.int64)),
        "scores": torch.tensor(np.array(scores, dtype=np.float32)),
    }
    if gt_masks is not None:
        shape = (len(masks), 1, *gt_masks.shape[1:])
        out["masks"] = torch.tensor(np.array(masks, dtype=np.float32).reshape(shape))
    return out


class StandInDetector(nn.Module):
    """Eval-mode detector interface; the answer for an image is looked up by its pixels."""

    def __init__(self, dataset: CocoDetection):
        super().__init__()
        k = len(dataset.classes)
        self.answers = {}
        for i in range(len(dataset)):
            image, target = dataset[i]
            self.answers[_key(image)] = fake_predictions(target, k)

    def forward(self, images):
        return [{k: v.to(img.device) for k, v in self.answers[_key(img)].items()} for img in images]


def val_set(root: str, masks: bool = False) -> CocoDetection:
    return CocoDetection(
        Path(root) / "val",
        Path(root) / "annotations" / "instances_val.json",
        train=False,
        masks=masks,
    )


def loader(dataset: CocoDetection, dp_rank: int, dp: int, batch: int = 3) -> DataLoader:
    return DataLoader(
        dataset,
        batch_sampler=EvalBatchSampler(len(dataset), batch, dp_rank, dp),
        collate_fn=collate_detection,
    )


def run(root: str, out_dir: str, claimed_images: int = 0, masks: bool = False) -> dict:
    """Entry of every rank: evaluate the stand-in over a dp=world mesh; rank 0 writes
    detections.json (and, with `masks`, segmentations.json)."""
    from visiondist.evaluation.detection import evaluate_detection
    from visiondist.parallel import build_layout

    device = init_test_rank()
    try:
        world = dist.get_world_size()
        layout = build_layout(world, 1, 1, device, int(os.environ.get("LOCAL_RANK", 0)))
        data = val_set(root, masks)
        results = Path(out_dir) / "detections.json" if layout.rank == 0 else None
        try:
            stats = evaluate_detection(
                StandInDetector(data),
                loader(data, layout.dp_rank, world),
                layout,
                data.ann_file,
                data.cat_of,
                claimed_images or len(data),
                results_path=results,
            )
        except RuntimeError as exc:  # reported back, so the test sees what every rank raised
            return {"error": str(exc)}
        return {
            "stats": stats,
            "shard": len(loader(data, layout.dp_rank, world).batch_sampler.indices),
        }
    finally:
        dist.destroy_process_group()
