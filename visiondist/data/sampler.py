"""Samplers keyed by the data-parallel rank.

Training: one shuffled order per epoch, cut into global batches; data-parallel rank r takes the r-th
contiguous slice of every global batch, split again into `grad_accum` micro-batches. The samples of
one optimizer step are therefore the same whatever the number of DP ranks, which is what makes a
dp=N run equal a one-process run. Each key carries the epoch, so per-sample augmentation can be
seeded by (seed, epoch, index) and not by which rank or worker loads it.

With `groups` (e.g. landscape / portrait images for detection), every global batch is drawn from one
group: the epoch's shuffled order is walked and each sample joins its group's pending batch, which
is emitted when full (as torchvision's GroupedBatchSampler does, but on global batches, so the DP
split above still holds). A group's leftover (< one global batch) waits for the next epoch, so an
epoch has sum over groups of floor(size / batch) steps. A group smaller than one global batch, which
would never fill one, is batched with the largest group.

With `streams` (packed shards, `visiondist.data.shards`), the epoch's order is shard-aware: the
shards are shuffled, the samples within each, and the sequence is cut into `streams` equal parts;
global batch b is the b-th run of batch / streams samples of every part, in part order. The batch is
still a function of the seed and the epoch only, and DP rank r's slice holds whole parts when the
ranks divide the streams: each rank (and node) then reads about 1 / ranks of the shards per epoch
instead of all of them, as MosaicML Streaming's canonical nodes do.

Evaluation: every sample exactly once across ranks, as contiguous shards of near-equal size (no
padding duplicates).
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import numpy as np

SampleKey = tuple[int, int]  # (dataset index, epoch)


# data.streams=-1: at most this many parts of an epoch's shard-aware order
AUTO_STREAMS = 8


def shard_streams(streams: int, global_batch: int) -> int:
    """`data.streams` made concrete: as given when positive; -1: the largest divisor of the global
    batch up to `AUTO_STREAMS` (8 for a batch of 8k, 6 for 60, 4 for 4)."""
    if streams > 0:
        return streams
    return max(n for n in range(1, AUTO_STREAMS + 1) if global_batch % n == 0)


class TrainBatchSampler:
    """Yields this DP rank's micro-batches of `SampleKey`s; `grad_accum` of them make one optimizer
    step."""

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        dp_rank: int,
        dp_size: int,
        grad_accum: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        groups: Optional[np.ndarray] = None,
        streams: int = 0,
        shard_starts: Optional[np.ndarray] = None,
    ):
        if global_batch % (dp_size * grad_accum):
            raise ValueError(
                f"global batch {global_batch} is not divisible by dp x grad_accum = "
                f"{dp_size * grad_accum}"
            )
        if num_samples < global_batch:
            raise ValueError(
                f"the training set has {num_samples} samples, fewer than one global batch of "
                f"{global_batch}: lower data.batch_size"
            )
        self.num_samples, self.global_batch = num_samples, global_batch
        self.dp_rank, self.dp_size, self.grad_accum = dp_rank, dp_size, grad_accum
        self.seed, self.shuffle = seed, shuffle
        self.groups, self.joined = None, 0
        if groups is not None:
            self.groups, self.joined = joined_small_groups(np.asarray(groups), global_batch)
        self.local_batch = global_batch // dp_size
        self.micro_batch = self.local_batch // grad_accum
        self.streams, self.shard_starts = streams, shard_starts
        if streams:
            if global_batch % streams:
                raise ValueError(
                    f"data.batch_size={global_batch} is not divisible by data.streams={streams}: "
                    "set data.streams to a divisor of the batch (and a multiple of the number of "
                    "nodes)"
                )
            self.steps_per_epoch = (num_samples // streams) // (global_batch // streams)
        elif self.groups is None:
            self.steps_per_epoch = num_samples // global_batch
        else:
            if len(self.groups) != num_samples:
                raise ValueError(f"{len(self.groups)} group ids for {num_samples} samples")
            self.steps_per_epoch = int(
                sum(n // global_batch for n in np.unique(self.groups, return_counts=True)[1])
            )
        self.dropped_per_epoch = num_samples - self.steps_per_epoch * global_batch
        self.epoch = 0
        self.start_step = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Select the epoch's order; `start_step` skips optimizer steps already taken (mid-epoch
        resume)."""
        self.epoch, self.start_step = epoch, start_step

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's global batches, in order (the same on every rank)."""
        if self.streams:
            return self._stream_batches(epoch)
        order = self.order(epoch)
        if self.groups is None:
            return [
                order[i * self.global_batch : (i + 1) * self.global_batch]
                for i in range(self.steps_per_epoch)
            ]
        pending: dict[int, list[int]] = {}
        batches = []
        for i in order:
            bucket = pending.setdefault(int(self.groups[i]), [])
            bucket.append(int(i))
            if len(bucket) == self.global_batch:
                batches.append(np.asarray(bucket))
                bucket.clear()
        return batches

    def _stream_batches(self, epoch: int) -> list[np.ndarray]:
        starts = self.shard_starts
        assert starts is not None, "streams= comes with shard_starts="
        rng = np.random.default_rng([self.seed, epoch])
        shards = rng.permutation(len(starts) - 1) if self.shuffle else np.arange(len(starts) - 1)
        sequence = np.concatenate(
            [
                starts[k]
                + (
                    rng.permutation(starts[k + 1] - starts[k])
                    if self.shuffle
                    else np.arange(starts[k + 1] - starts[k])
                )
                for k in shards
            ]
        )
        per_part = self.num_samples // self.streams
        parts = sequence[: self.streams * per_part].reshape(self.streams, per_part)
        run = self.global_batch // self.streams
        return [parts[:, b * run : (b + 1) * run].reshape(-1) for b in range(self.steps_per_epoch)]

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.grad_accum

    def images(self, first: int, last: int) -> int:
        """The images of the run's steps first + 1 .. last (counted from 1), over all ranks."""
        return (last - first) * self.global_batch

    def __iter__(self) -> Iterator[list[SampleKey]]:
        epoch = self.epoch
        batches = self.global_batches(epoch)
        lo = self.dp_rank * self.local_batch
        for step in range(self.start_step, self.steps_per_epoch):
            mine = batches[step][lo : lo + self.local_batch]
            for a in range(self.grad_accum):
                chunk = mine[a * self.micro_batch : (a + 1) * self.micro_batch]
                yield [(int(i), epoch) for i in chunk]


def joined_small_groups(groups: np.ndarray, global_batch: int) -> tuple[np.ndarray, int]:
    """(`groups` with each group of fewer samples than `global_batch` joined to the largest, the
    samples joined): a group that never fills a batch would never be trained."""
    ids, counts = np.unique(groups, return_counts=True)
    small = ids[counts < global_batch]
    if not len(small) or len(ids) == 1:
        return groups, 0
    largest = ids[np.argmax(counts)]
    joined = np.isin(groups, small)
    out = groups.copy()
    out[joined] = largest
    return out, int(joined.sum())


def eval_shard(num_samples: int, dp_rank: int, dp_size: int) -> range:
    """This rank's contiguous share of [0, num_samples); the shares partition the range exactly."""
    return range(num_samples * dp_rank // dp_size, num_samples * (dp_rank + 1) // dp_size)


class EvalBatchSampler:
    """Batches of this DP rank's evaluation shard, in order; shards differ in size by at most one
    sample. With `groups` (a key per sample), a batch holds samples of one key only, each batch
    formed in shard order: a detector that pads a batch to its largest image then gives every image
    what it gives it alone, whatever the ranks and the batch size (`padded_shapes`)."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        dp_rank: int,
        dp_size: int,
        groups: Optional[np.ndarray] = None,
    ):
        self.indices = eval_shard(num_samples, dp_rank, dp_size)
        self.batch_size = batch_size
        self._batches = None if groups is None else grouped(self.indices, batch_size, groups)

    def __len__(self) -> int:
        if self._batches is not None:
            return len(self._batches)
        return -(-len(self.indices) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        if self._batches is not None:
            yield from (list(b) for b in self._batches)
            return
        for start in range(0, len(self.indices), self.batch_size):
            yield list(self.indices[start : start + self.batch_size])


def grouped(indices: range, batch_size: int, groups: np.ndarray) -> list[list[int]]:
    """`indices` in batches of one group each: a batch is yielded when it is full, the partial ones
    at the end, in the order of their first sample."""
    pending: dict[Any, list[int]] = {}
    batches: list[list[int]] = []
    for i in indices:
        key = tuple(groups[i].tolist()) if groups.ndim > 1 else groups[i].item()
        batch = pending.setdefault(key, [])
        batch.append(i)
        if len(batch) == batch_size:
            batches.append(pending.pop(key))
    rest = sorted(pending.values(), key=lambda b: b[0])
    return batches + rest


def padded_shapes(
    sizes: np.ndarray, min_size: int, max_size: int, divisible: int = 32
) -> np.ndarray:
    """The (height, width) torchvision's detection transform pads each image to when alone, from
    its (width, height) in `sizes`: resized so that its shorter side is `min_size` unless its
    longer one would pass `max_size` (the transform's arithmetic: floor(side x scale)), then each
    side rounded up to `divisible`. Images of one such shape batch together without padding each
    other."""
    out = np.zeros((len(sizes), 2), dtype=np.int64)
    for i, (width, height) in enumerate(sizes.tolist()):
        scale = min(min_size / min(height, width), max_size / max(height, width))
        h, w = math.floor(float(height) * scale), math.floor(float(width) * scale)
        out[i] = (math.ceil(h / divisible) * divisible, math.ceil(w / divisible) * divisible)
    return out
