"""Data: datasets, transforms and DP-rank-keyed samplers, assembled into loaders."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import cv2
from torch.utils.data import DataLoader

from visiondist.data.builtin import ensure_shapes
from visiondist.data.imagefolder import ImageFolder
from visiondist.data.sampler import EvalBatchSampler, TrainBatchSampler
from visiondist.data.transforms import SeededTransform, classification_transforms

log = logging.getLogger(__name__)

GENERATORS = {"shapes": ensure_shapes}  # built-in datasets, generated on first use


def prepare_data(cfg, show_progress: bool = False) -> None:
    """Generate a built-in dataset if it is missing. Call on one rank per node, then barrier."""
    if cfg.synthetic is None:
        return
    if cfg.name not in GENERATORS:
        raise ValueError(f"data.synthetic is set but there is no built-in dataset named {cfg.name!r}")
    GENERATORS[cfg.name](cfg.root, cfg.synthetic, show_progress=show_progress)


def _worker_init(_worker_id: int) -> None:
    cv2.setNumThreads(1)  # loader workers are the parallelism; OpenCV's own threads would oversubscribe


@dataclass
class ClassificationData:
    train_loader: DataLoader
    val_loader: DataLoader
    train_sampler: TrainBatchSampler
    classes: list[str]
    num_train: int
    num_val: int


def build_classification_data(
    cfg, img_size: int, dp_rank: int, dp_size: int, grad_accum: int, seed: int, pin_memory: bool
):
    """Train and val loaders for this DP rank, at the model's input size. `cfg` is the data config; batch sizes in it
    are global."""
    root = Path(cfg.root).expanduser()
    train_tf = SeededTransform(classification_transforms(cfg, train=True, size=img_size), seed)
    val_tf = SeededTransform(classification_transforms(cfg, train=False, size=img_size), seed)
    train_set = ImageFolder(root / cfg.train_split, train_tf)
    val_set = ImageFolder(root / cfg.val_split, val_tf)
    if len(train_set.classes) != cfg.num_classes:
        raise ValueError(
            f"data.num_classes={cfg.num_classes} but {train_set.root} has {len(train_set.classes)} class folders: "
            f"set data.num_classes={len(train_set.classes)}"
        )
    if val_set.classes != train_set.classes:
        raise ValueError(f"class folders of {val_set.root} differ from those of {train_set.root}")

    sampler = TrainBatchSampler(len(train_set), cfg.batch_size, dp_rank, dp_size, grad_accum, seed=seed)
    if sampler.dropped_per_epoch:
        log.info(
            "training uses %d of %d samples per epoch (%d global batches of %d); %d samples, a different random set "
            "each epoch, wait for the next",
            sampler.steps_per_epoch * cfg.batch_size, len(train_set), sampler.steps_per_epoch, cfg.batch_size,
            sampler.dropped_per_epoch,
        )
    common = dict(
        num_workers=cfg.num_workers,
        pin_memory=pin_memory,
        worker_init_fn=_worker_init,
        persistent_workers=cfg.num_workers > 0,
    )
    train_loader = DataLoader(train_set, batch_sampler=sampler, **common)
    eval_batch = -(-cfg.eval_batch_size // dp_size)
    val_loader = DataLoader(val_set, batch_sampler=EvalBatchSampler(len(val_set), eval_batch, dp_rank, dp_size), **common)
    return ClassificationData(train_loader, val_loader, sampler, train_set.classes, len(train_set), len(val_set))
