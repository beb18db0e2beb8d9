"""Exact distributed classification metrics (top-1, top-5, val loss, per-class top-1, and up to
`CONFUSION_MAX_CLASSES` classes the confusion matrix): each rank scores its shard, sums are reduced
over data parallel. Top-5 is computed always and reported above 10 classes (`reports_top5`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from visiondist.data.workers import watched
from visiondist.observe.progress import tracked
from visiondist.parallel import Layout, PipelinedViT, blank_forwards, forwards_needed

TOP5_MIN_CLASSES = 11  # top-5 is reported from 11 classes up (k at most about half the class count)
# the confusion matrix is counted up to this many classes (k x k sums reduced each evaluation: 80 KB
# at 100; ImageNet's 1000 would be 8 MB, and a plot nobody reads)
CONFUSION_MAX_CLASSES = 100


def reports_top5(num_classes: int) -> bool:
    """Whether top-5 is reported (the log, metrics.csv, the summary, the plots, eval.json): only
    where five guesses are well below the class count, more than 10 classes. Of 6 classes, five
    guesses miss only when the true class is ranked last: top-5 is about 100% for any model and says
    nothing.

    Args:
        num_classes: the classifier's class count.
    """
    return num_classes >= TOP5_MIN_CLASSES


def topk_correct(
    logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...]
) -> list[torch.Tensor]:
    """Number of samples whose label is among the top-k logits, for each k (k capped at the class
    count).

    Args:
        logits: (N, classes).
        labels: (N,) true labels.
        ks: the k of each count, e.g. (1, 5).

    Returns:
        A 0-d tensor per k, on the logits' device.
    """
    kmax = min(max(ks), logits.shape[1])
    top = logits.topk(kmax, dim=1).indices
    hits = top == labels[:, None]
    return [hits[:, : min(k, kmax)].any(dim=1).sum() for k in ks]


@torch.no_grad()
def evaluate_classification(
    model: nn.Module,
    loader: DataLoader,
    layout: Layout,
    autocast: AbstractContextManager | None = None,
    num_classes: int | None = None,
    progress: bool = False,
    inputs=None,
    feed=None,
) -> dict[str, Any]:
    """A classifier's exact val metrics over every rank's share of the val set.

    val_loss, val_top1, val_top5 (percent) and val_count over the whole val set, identical on
    every rank; with `num_classes`, also val_class_top1 (percent per class, None for a class without
    images), val_class_count and, up to `CONFUSION_MAX_CLASSES`, val_confusion (image counts, row:
    the true class, column: the predicted one). `progress`: a progress bar over this rank's batches
    (give it on the main rank only). `inputs(images, device)` turns loader images into the model's
    input on the device (default: a copy; the task's `Normalize` for uint8). `feed(batches)` gives
    the loader's batches as the step takes them (data.decode_on=device: decoded ahead, off the
    model's stream; closed at the end).

    A pipelined model runs each batch through the pipeline (`PipelinedViT.predict`); the last stage
    scores it and its sums reach the other stages in the final reduction.

    Args:
        model: the model (any layout: DDP, TP, FSDP, a `PipelinedViT`).
        loader: this rank's val batches (images, labels).
        layout: this rank's `Layout` (device, the DP group).
        autocast: the forward's autocast context; None: none.
        num_classes: the class count, for per-class top-1; None: none.
        progress: a progress bar over this rank's batches.
        inputs: (images, device) -> the model's input; None: a copy to the device.
        feed: batches -> the batches as the step takes them; None: as they come.

    Returns:
        The metrics by name (val_class_top1 and val_class_count: lists).
    """
    was_training = model.training
    model.eval()
    pipelined = isinstance(model, PipelinedViT)
    k = num_classes or 0
    # loss, top1, top5, count, per class, the confusion matrix (row: true class, column: predicted)
    sums = torch.zeros(4 + 2 * k + _confused(k) ** 2, dtype=torch.float64, device=layout.device)
    needed = forwards_needed(model, layout, len(loader))  # FSDP: every rank runs as many forwards
    inputs = inputs or (lambda images, device: images.to(device, non_blocking=True))
    # a loader worker's death names the worker (not a bare EOFError)
    batches = watched(iter(loader))
    batches = feed(batches) if feed is not None else batches
    try:
        forwards = _forward_all(
            model, loader, batches, layout, autocast, inputs, pipelined, sums, k, progress
        )
    finally:
        if hasattr(batches, "close"):
            batches.close()
    blank_forwards(model, layout, needed - forwards, autocast)
    layout.all_reduce_dp(sums)
    if isinstance(model, PipelinedViT):
        sums = model.from_last_stage(sums)
    model.train(was_training)
    return _metrics(sums.tolist(), k)


def _forward_all(
    model,
    loader,
    batches,
    layout: Layout,
    autocast,
    inputs,
    pipelined: bool,
    sums: torch.Tensor,
    k: int,
    progress: bool,
) -> int:
    """Score every batch of this rank into `sums`; returns the forwards run."""
    forwards = 0
    for images, labels in tracked(batches, progress, total=len(loader)):
        forwards += 1
        images = None if images is None else inputs(images, layout.device)
        if pipelined:
            logits = model.predict(
                images,
                None if labels is None else len(labels),
                loader.batch_sampler.batch_size,
                autocast,
            )
            if logits is None:
                continue
        else:
            with autocast or nullcontext():
                logits = model(images)
        _score(sums, logits.float(), labels.to(layout.device, non_blocking=True), k)
    return forwards


def _score(sums: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, k: int) -> None:
    """Add one batch's loss, top-1 / top-5 hits and count (and per-class hits and counts over k
    classes) to `sums`."""
    top1, top5 = topk_correct(logits, labels, (1, 5))
    loss = F.cross_entropy(logits, labels, reduction="sum")
    count = torch.tensor(float(len(labels)), dtype=torch.float64, device=sums.device)
    sums[:4] += torch.stack([loss.double(), top1.double(), top5.double(), count])
    if k:
        predicted = logits.argmax(dim=1)
        hit = predicted == labels
        sums[4 : 4 + k] += torch.bincount(labels[hit], minlength=k).double()
        sums[4 + k : 4 + 2 * k] += torch.bincount(labels, minlength=k).double()
        if _confused(k):
            sums[4 + 2 * k :] += torch.bincount(labels * k + predicted, minlength=k * k).double()


def _confused(k: int) -> int:
    """The confusion matrix's side for `k` classes: k up to `CONFUSION_MAX_CLASSES`, else 0."""
    return k if k <= CONFUSION_MAX_CLASSES else 0


def _metrics(values: list[float], k: int) -> dict:
    """The reduced sums as metrics (see `evaluate_classification`)."""
    loss, top1, top5, count = values[:4]
    count_safe = max(count, 1.0)
    metrics: dict[str, Any] = {
        "val_loss": loss / count_safe,
        "val_top1": 100.0 * top1 / count_safe,
        "val_top5": 100.0 * top5 / count_safe,
        "val_count": int(count),
    }
    if k:
        hits, counts = values[4 : 4 + k], values[4 + k : 4 + 2 * k]
        metrics["val_class_top1"] = [100.0 * h / c if c else None for h, c in zip(hits, counts)]
        metrics["val_class_count"] = [int(c) for c in counts]
        if _confused(k):
            cells = values[4 + 2 * k :]
            metrics["val_confusion"] = [
                [int(v) for v in cells[i * k : (i + 1) * k]] for i in range(k)
            ]
    return metrics
