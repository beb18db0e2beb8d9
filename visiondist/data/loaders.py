"""A task's loaders: `build_classification_data` (train and val loaders, sharded by DP rank, from a
tree or from packed shards), with the loader options every split shares (workers, pinning,
prefetch), the val loader every task uses, and the class count's check. A detection task's:
`visiondist.data.detection_loaders`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader

from visiondist.config.resolution import native_settings
from visiondist.data.device_decode import (
    collate_encoded,
    encoded_or_decoded,
    read_encoded,
)
from visiondist.data.imagefolder import ImageFolder
from visiondist.data.native import NativeBatchSampler, NativeCollate, NativeTransform
from visiondist.data.sampler import EvalBatchSampler, TrainBatchSampler, shard_streams
from visiondist.data.shards import ShardSplit, open_store, read_meta
from visiondist.data.transforms import ClassificationTransform
from visiondist.data.workers import (
    AUTO_WORKERS_MAX,
    loader_workers,
    register,
    usable_cores,
    worker_init,
)
from visiondist.utils.procenv import ranks_sharing_cpus

log = logging.getLogger(__name__)


def loader_options(cfg, pin_memory: bool, collate_fn=None) -> dict:
    # Augmentation is seeded per sample; the loader's own generator only keeps it from drawing
    # worker seeds from the global torch RNG, whose state a checkpoint restores. Workers stay alive
    # across epochs and each prepares `data.prefetch_factor` batches ahead; on a GPU the batches
    # come in page-locked memory (`data.pin_memory`) so that the rank's copy to the device does not
    # block.
    num_workers = _num_workers(cfg.num_workers)
    workers = num_workers > 0
    # the rank's OpenCV thread pool, if it has started one, must not be copied into forked workers:
    # a
    if workers:
        # worker's first resize would wait on threads it does not have. The rank decodes nothing
        # itself.

        cv2.setNumThreads(1)
    return dict(
        num_workers=num_workers,
        pin_memory=pin_memory and cfg.get("pin_memory", True),
        worker_init_fn=worker_init,
        persistent_workers=workers,
        collate_fn=collate_fn,
        prefetch_factor=cfg.get("prefetch_factor", 2) if workers else None,
        generator=torch.Generator(),
    )


def _num_workers(requested: int) -> int:
    """`data.num_workers`; -1: what this node's cores allow each of its ranks
    (`visiondist.data.workers.loader_workers`), logged once a process."""
    # this node's ranks (torchrun, srun, the self-launch) that share this process's CPUs
    ranks = ranks_sharing_cpus(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    workers = loader_workers(requested, ranks)
    line = (
        f"data.num_workers=-1: {workers} loader worker{'' if workers == 1 else 's'} per rank "
        f"({usable_cores()} CPUs this process may use, {ranks} rank{'' if ranks == 1 else 's'} "
        f"sharing them, one CPU each for the rank itself; at most {AUTO_WORKERS_MAX})"
    )
    # once a process: the loaders a job builds (train and val, each prediction) share it
    if requested < 0 and line not in _SAID:
        _SAID.add(line)
        log.info(line)
    return workers


_SAID: set[str] = set()


def val_loader_of(
    cfg, val_set, dp_rank: int, dp_size: int, options: dict, groups: Optional[np.ndarray] = None
) -> DataLoader:
    """This DP rank's exact share of the val set (no padding duplicates); with `groups`, a batch
    holds images of one group only (`EvalBatchSampler`)."""
    eval_batch = -(-cfg.eval_batch_size // dp_size)
    return register(
        DataLoader(
            val_set,
            batch_sampler=EvalBatchSampler(len(val_set), eval_batch, dp_rank, dp_size, groups),
            **options,
        )
    )


class LabelBatches:
    """The batches of a batch sampler as `(None, labels)`, without reading an image: what the last
    pipeline stage consumes (the first reads the images). With `labels=None`, `(None, None)`: a
    middle stage only steps along."""

    def __init__(self, batch_sampler, labels: np.ndarray | None):
        self.batch_sampler, self.labels = batch_sampler, labels

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        for keys in self.batch_sampler:
            if self.labels is None:
                yield None, None
                continue
            index = [k[0] if isinstance(k, tuple) else k for k in keys]
            yield None, torch.from_numpy(self.labels[index])


def check_num_classes(cfg, found: int, source: Path, what: str) -> None:
    if found != cfg.num_classes:
        raise ValueError(
            f"data.num_classes={cfg.num_classes} but {source} has {found} {what}: "
            f"set data.num_classes={found}"
        )


@dataclass
class TaskData:
    """A task's loaders and what the trainer reads off its data (no train loader / sampler:
    evaluation only). A pipeline stage that reads no image gets `LabelBatches` as its loaders."""

    train_loader: DataLoader | LabelBatches | None
    val_loader: DataLoader | LabelBatches
    train_sampler: TrainBatchSampler | None
    classes: list[str]
    num_train: int
    num_val: int


@dataclass
class ClassificationData(TaskData):
    """A classification task's loaders (`build_classification_data`).

    Args:
        train_loader: this rank's training batches (images, labels); None: evaluation only.
        val_loader: this rank's share of the val split, every image once over the ranks.
        train_sampler: the training order (epochs, steps, a resumed step); None: evaluation only.
        classes: the class names, in label order.
        num_train: the training split's image count (0: evaluation only).
        num_val: the val split's image count.
        store: the rank's `ShardStore` under data.format=shards, else None.
    """

    # data.format=shards: the rank's `ShardStore` (its `fetched` bytes go into the summary)
    store: object = None


def build_classification_data(
    cfg,
    img_size: int,
    dp_rank: int,
    dp_size: int,
    grad_accum: int,
    seed: int,
    pin_memory: bool,
    reads_images: bool = True,
    reads_labels: bool = True,
    train: bool = True,
    patch_size: int = 16,
):
    """Train and val loaders for this DP rank, at the model's input size.

    `cfg` is the data config; batch sizes in it are global. A rank that does not read images (a
    later pipeline stage) gets `LabelBatches` of the same samples. With `train=False` only the val
    split is read (evaluation of weights: no train split needed). Under `data.resolution=native` the
    images keep their aspect ratio and come as patch sequences of `patch_size` pixels
    (`visiondist.data.native`).

    Args:
        cfg: the data config (`data`): an ImageFolder tree or packed shards.
        img_size: the model's input side in pixels.
        dp_rank: this rank's data-parallel index.
        dp_size: the data-parallel ranks.
        grad_accum: micro-batches per optimizer step.
        seed: the run's seed (sample order, per-sample augmentation).
        pin_memory: batches in page-locked memory (a GPU run).
        reads_images: False for a pipeline stage that takes no images.
        reads_labels: False for a stage that takes no labels either.
        train: False to read the val split alone.
        patch_size: the ViT's patch side (data.resolution=native).

    Returns:
        A `ClassificationData`.
    """
    if cfg.get("resolution", "square") == "native":
        return _native_data(
            cfg, img_size, patch_size, dp_rank, dp_size, grad_accum, seed, pin_memory, train
        )
    val_tf = ClassificationTransform(cfg, train=False, size=img_size, seed=seed)
    splits = classification_splits(cfg)
    reader, collate = None, None
    # the workers read bytes; the rank decodes them on its device (train and val: one decoder),
    if cfg.get("decode_on", "loader") == "device":
        reader, collate = (
            read_encoded,
            collate_encoded(img_size, cfg.get("interpolation", "bilinear")),
        )
    val_set = splits(cfg.val_split, val_tf, reader=reader)
    options = loader_options(cfg, pin_memory)
    val_options = {**options, **({"collate_fn": collate} if collate else {})}
    if not train:
        check_num_classes(cfg, len(val_set.classes), val_set.root, "class folders")
        val_loader: DataLoader | LabelBatches = val_loader_of(
            cfg, val_set, dp_rank, dp_size, val_options
        )
        if not reads_images:
            val_loader = LabelBatches(
                val_loader.batch_sampler, val_set.targets if reads_labels else None
            )
        return ClassificationData(None, val_loader, None, val_set.classes, 0, len(val_set))
    train_tf = ClassificationTransform(cfg, train=True, size=img_size, seed=seed)
    train_set = splits(
        cfg.train_split,
        train_tf,
        train=True,
        max_bad_images=cfg.get("max_bad_images", 10),
        reader=reader,
    )
    check_num_classes(cfg, len(train_set.classes), train_set.root, "class folders")
    if val_set.classes != train_set.classes:
        raise ValueError(f"class folders of {val_set.root} differ from those of {train_set.root}")

    streams = {}
    if cfg.get("format") == "shards":  # each rank reads about 1 / ranks of the shards per epoch
        streams = dict(
            streams=shard_streams(int(cfg.streams), cfg.batch_size),
            shard_starts=train_set.shard_starts,
        )
    sampler = TrainBatchSampler(
        len(train_set), cfg.batch_size, dp_rank, dp_size, grad_accum, seed=seed, **streams
    )
    train_loader: DataLoader | LabelBatches = register(
        DataLoader(train_set, batch_sampler=sampler, **val_options)
    )
    val_loader = val_loader_of(cfg, val_set, dp_rank, dp_size, val_options)
    if not reads_images:
        train_loader = LabelBatches(sampler, train_set.targets if reads_labels else None)
        val_loader = LabelBatches(
            val_loader.batch_sampler, val_set.targets if reads_labels else None
        )
    return ClassificationData(
        train_loader,
        val_loader,
        sampler,
        train_set.classes,
        len(train_set),
        len(val_set),
        getattr(train_set, "store", None),
    )


def _native_data(
    cfg,
    img_size: int,
    patch: int,
    dp_rank: int,
    dp_size: int,
    grad_accum: int,
    seed: int,
    pin_memory: bool,
    train: bool,
) -> ClassificationData:
    """`build_classification_data` under data.resolution=native: the same splits, each image resized
    to its grid."""
    seq_lens, eval_len = native_settings(cfg, img_size, patch)
    packs = bool((cfg.get("native") or {}).get("pack", False))
    splits = classification_splits(cfg)
    # whole grids
    val_set = splits(cfg.val_split, NativeTransform(cfg, False, patch, seed, eval_len, img_size))
    val_loader = val_loader_of(
        cfg,
        val_set,
        dp_rank,
        dp_size,
        loader_options(cfg, pin_memory, NativeCollate(patch, [eval_len], packs)),
    )
    if not train:
        check_num_classes(cfg, len(val_set.classes), val_set.root, "class folders")
        return ClassificationData(None, val_loader, None, val_set.classes, 0, len(val_set))
    train_tf = NativeTransform(cfg, True, patch, seed, eval_len, img_size, packs)
    train_set = splits(
        cfg.train_split, train_tf, train=True, max_bad_images=cfg.get("max_bad_images", 10)
    )
    check_num_classes(cfg, len(train_set.classes), train_set.root, "class folders")
    if val_set.classes != train_set.classes:
        raise ValueError(f"class folders of {val_set.root} differ from those of {train_set.root}")
    sampler = NativeBatchSampler(
        len(train_set),
        cfg.batch_size,
        (img_size // patch) ** 2,
        seq_lens,
        dp_rank,
        dp_size,
        grad_accum,
        seed,
        packs,
    )
    train_loader = register(
        DataLoader(
            train_set,
            batch_sampler=sampler,
            **loader_options(cfg, pin_memory, NativeCollate(patch, seq_lens, packs)),
        )
    )
    return ClassificationData(
        train_loader,
        val_loader,
        sampler,
        train_set.classes,
        len(train_set),
        len(val_set),
        getattr(train_set, "store", None),
    )


def classification_splits(cfg):
    """split name, transform, options -> the split's dataset: an `ImageFolder` under
    `<root>/<split>`, or a packed split (`data.format=shards`) read through one store per rank."""
    if cfg.get("format", "imagefolder") != "shards":
        root = Path(cfg.root).expanduser()
        return lambda split, transform, reader=None, **kw: ImageFolder(
            root / split, transform, reader=reader, **kw
        )

    store = open_store(cfg)
    meta = read_meta(store)

    def split_of(split, transform, reader=None, **kw):
        decode = encoded_or_decoded if reader is read_encoded else None
        return ShardSplit(store, split, transform, reader=decode, meta=meta, **kw)

    return split_of
