"""A detection task's loaders: `build_detection_data` (COCO-format train and val loaders, sharded by
DP rank, from a tree or from packed shards; training batches grouped by aspect ratio, val batches by
padded shape) and the reader of a config's splits (`detection_splits`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from torch.utils.data import DataLoader

from visiondist.data.coco import CocoDetection, collate_detection
from visiondist.data.formats.exports import coco_paths
from visiondist.data.loaders import TaskData, check_num_classes, loader_options, val_loader_of
from visiondist.data.sampler import TrainBatchSampler, padded_shapes, shard_streams
from visiondist.data.shards import open_store, read_meta
from visiondist.data.shards.packed_coco import ShardCoco
from visiondist.data.transforms import DetectionTransform
from visiondist.data.workers import register


@dataclass
class DetectionData(TaskData):
    """A detection task's loaders (`build_detection_data`).

    Args:
        train_loader: this rank's training batches (lists of images and of targets); None:
            evaluation only.
        val_loader: this rank's share of the val split, every image once over the ranks.
        train_sampler: the training order (epochs, steps, a resumed step); None: evaluation only.
        classes: the category names of labels 1..K.
        num_train: the training split's image count (0: evaluation only).
        num_val: the val split's image count.
        val_annotations: the val split's COCO annotation file.
        cat_of_label: the COCO category id of each label 1..K.
        store: the rank's `ShardStore` under data.format=shards, else None.
    """

    val_annotations: Path  # the ground truth COCOeval scores against
    cat_of_label: dict[int, int]  # model label (1..K) -> COCO category id
    store: object = None  # data.format=shards: the rank's `ShardStore`


def build_detection_data(
    cfg,
    dp_rank: int,
    dp_size: int,
    grad_accum: int,
    seed: int,
    pin_memory: bool,
    train: bool = True,
    masks: bool = False,
    square: int | None = None,
    antialias: bool = True,
    padded_by: Optional[tuple[int, int]] = None,
):
    """COCO-format train / val loaders for this DP rank.

    Batches are lists: images differ in size. With `train=False` only the val split is read
    (evaluation of a checkpoint). `masks`: the training targets carry instance masks (a model with a
    mask head; COCOeval reads the val masks from the annotation file). `square`: training images are
    resized to that square (a DETR-class detector's input) instead of by data.min_size / max_size,
    antialiased when they shrink unless `antialias` is off (as the model's image processor
    resizes).

    Args:
        cfg: the data config (`data`): a COCO-format tree or packed shards.
        dp_rank: this rank's data-parallel index.
        dp_size: the data-parallel ranks.
        grad_accum: micro-batches per optimizer step.
        seed: the run's seed (sample order, per-sample augmentation).
        pin_memory: batches in page-locked memory (a GPU run).
        train: False to read the val split alone.
        masks: training targets with instance masks.
        square: the side training images are resized to; None: data.min_size / max_size.
        antialias: antialias a `square` resize that shrinks.
        padded_by: the model's (min_size, max_size) where it resizes each image and pads a batch
            to its largest (torchvision's detectors): each val batch holds images of one padded
            shape (`sampler.padded_shapes`), so that an image's detections do not depend on the
            ranks or the batch size. None: a model that sees every image at one size.

    Returns:
        A `DetectionData`.
    """
    options = loader_options(cfg, pin_memory, collate_detection)
    splits = detection_splits(cfg)
    val_set = splits(cfg.val_split, train=False)
    shapes = None if padded_by is None else padded_shapes(val_set.image_sizes(), *padded_by)
    val_loader = val_loader_of(cfg, val_set, dp_rank, dp_size, options, shapes)
    if not train:
        return DetectionData(
            None,
            val_loader,
            None,
            val_set.classes,
            0,
            len(val_set),
            val_set.ann_file,
            val_set.cat_of,
        )
    train_set = splits(
        cfg.train_split,
        train=True,
        transform=DetectionTransform(cfg, seed, square, antialias),
        max_bad_images=cfg.max_bad_images,
        masks=masks,
    )
    check_num_classes(cfg, len(train_set.classes), train_set.ann_file, "categories")
    if val_set.label_of != train_set.label_of:
        raise ValueError(
            f"the categories of {val_set.ann_file} differ from those of {train_set.ann_file}"
        )
    # grouping by aspect ratio keeps a batch's padding small. Square inputs (DETR-class) have none
    # to save, but keep it: it decides which images share a batch, and D-FINE-N's shapes_coco result
    # (benchmarks/RESULTS.md) was measured with it; another sample order left that run on its loss
    # plateau for all 4 epochs
    groups = (train_set.aspect_ratios() >= 1).astype(np.int64) if cfg.aspect_grouping else None
    streams = {}
    # grouping by aspect draws each batch from the whole epoch
    if cfg.get("format") == "shards" and groups is None:
        streams = dict(
            streams=shard_streams(int(cfg.streams), cfg.batch_size),
            shard_starts=train_set.shard_starts,
        )
    sampler = TrainBatchSampler(
        len(train_set),
        cfg.batch_size,
        dp_rank,
        dp_size,
        grad_accum,
        seed=seed,
        groups=groups,
        **streams,
    )
    train_loader = register(DataLoader(train_set, batch_sampler=sampler, **options))
    return DetectionData(
        train_loader,
        val_loader,
        sampler,
        train_set.classes,
        len(train_set),
        len(val_set),
        val_set.ann_file,
        val_set.cat_of,
        getattr(train_set, "store", None),
    )


def detection_splits(cfg):
    """The reader of a COCO-format data config's splits.

    split name, options -> a `CocoDetection` of the tree, or of a packed split
    (`data.format=shards`).

    Args:
        cfg: the data config.

    Returns:
        A function of (split name, `CocoDetection`'s keyword options) -> the split's dataset.
    """
    if cfg.get("format", "imagefolder") != "shards":
        return lambda split, **kw: CocoDetection(*coco_paths(cfg, split), **kw)

    store = open_store(cfg)
    meta = read_meta(store)
    return lambda split, **kw: ShardCoco(store, split, meta=meta, **kw)
