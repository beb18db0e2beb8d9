"""Classification data at each image's own aspect ratio (`data.resolution=native`, a ViT only): each
image is resized, aspect kept, to the largest grid of patches that fits its batch's sequence length,
and the batch goes to the model as patch sequences (`visiondist.models.patches.Patches`).

- Training draws each step's sequence length from `data.native.seq_lens`; the step's image count is
  the token budget (`data.batch_size` x the square model's token count, so a native step costs what
  a square one does) over that length, rounded down to a multiple of dp x grad_accum. The lengths
  are drawn once from the seed, the same every epoch, so that every epoch has the same number of
  steps; the images are shuffled per epoch as always, and each DP rank takes its contiguous slice of
  every step's images (`NativeBatchSampler`): a dp=N run sees the images of a one-process run, each
  image once per epoch.
- The train transform crops where albumentations' RandomResizedCrop draws (`data.train_crop_scale`,
  aspect 3/4 to 4/3), from the sample's own random stream, and resizes the crop to its grid, then
  flips; evaluation resizes the whole image to the grid of `data.native.eval_seq_len` tokens (no
  crop).
- A batch's images are one to a sequence, padded to its length (3.1% of the tokens on real
  photographs, benchmarks/native.py), or with `data.native.pack` several to a sequence (first fit,
  largest first; 4.7%). Packing pays only for images smaller than a sequence, so with it each
  training image's patch count is drawn between `PACK_SHARE` of its step's length (NaViT's
  resolution sampling), from the sample's own stream, and a step holds 1 / mean(that share) as many
  images for the same tokens.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import albumentations as A
import cv2
import numpy as np
import torch

from visiondist.config.resolution import PACK_SHARE, step_images
from visiondist.data.augment import AugmentPolicy
from visiondist.data.sampler import TrainBatchSampler
from visiondist.data.transforms import SampleRandom, interpolation
from visiondist.models.patches import Patches, pack


def fit_grid(height: int, width: int, patch: int, seq_len: int) -> tuple[int, int]:
    """The (rows, cols) grid of `patch`-pixel patches an image is resized to: the largest scale of
    the image whose sides, each rounded up to whole patches, hold at most `seq_len` patches; timm's
    NaFlex transforms' rule (`get_image_size_for_seq`), so that an export predicts in timm on the
    grids the run used."""
    # timm: 0.6 s a rank after torchvision, paid only at native resolution
    from timm.data.naflex_transforms import get_image_size_for_seq  # noqa: PLC0415 (timm: 0.6 s)

    _, (h, w) = get_image_size_for_seq((height, width), patch, seq_len)
    return h // patch, w // patch


class NativeTransform:
    """uint8 H x W x 3 -> uint8 rows*p x cols*p x 3 tensor, its aspect kept (module doc). Called
    with the sample's (index, epoch) and, in training, the sequence length of its step."""

    def __init__(
        self,
        cfg,
        train: bool,
        patch: int,
        seed: int,
        eval_seq_len: int,
        size: int = 224,
        pack: bool = False,
    ):
        self.train, self.patch, self.seed, self.eval_seq_len = train, patch, seed, eval_seq_len
        self.sizes_drawn = train and pack  # each image's share of its sequence drawn (module doc)
        # data.auto_augment (with data.augment_on=loader: check_native) on each resized image, here
        # in the worker
        self.policy = AugmentPolicy.from_config(cfg, size) if train else None
        self.hflip = float(cfg.hflip)
        self.flag = interpolation(cfg)
        self.random = SampleRandom()
        # its crop draw, not its resize
        self.draw = A.RandomResizedCrop(size=(patch, patch), scale=tuple(cfg.train_crop_scale))
        self.draw.set_random_state(self.random.numpy, self.random.python)

    def crop(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, left, height, width): albumentations' RandomResizedCrop draw (area in
        `data.train_crop_scale`, aspect log-uniform in 3/4..4/3, ten tries, then the centre at the
        nearest allowed aspect), from the sample's stream; only the draw, the resize is to the
        image's own grid."""
        x0, y0, x1, y1 = self.draw.get_params_dependent_on_data({"shape": (height, width)}, {})[
            "crop_coords"
        ]
        return y0, x0, y1 - y0, x1 - x0

    def __call__(self, image: np.ndarray, index: int, epoch: int, seq_len: int | None = None):
        """The resized image; in training with its step's sequence length, `(image, seq_len)` (the
        collate packs into sequences of that length)."""
        seq_len = self.eval_seq_len if seq_len is None else seq_len
        step_len = seq_len
        if self.train:
            self.random.reset(self.seed, epoch, index)
            top, left, h, w = self.crop(*image.shape[:2])
            image = image[top : top + h, left : left + w]
            if self.sizes_drawn:
                seq_len = max(1, int(seq_len * self.random.numpy.uniform(*PACK_SHARE)))
        rows, cols = fit_grid(image.shape[0], image.shape[1], self.patch, seq_len)
        size = (cols * self.patch, rows * self.patch)
        # data.interpolation, as the square crop resizes
        if (image.shape[1], image.shape[0]) != size:
            image = cv2.resize(image, size, interpolation=self.flag)
        if self.train and self.hflip > 0 and self.random.numpy.random() < self.hflip:
            image = image[:, ::-1]
        pixels = torch.from_numpy(np.ascontiguousarray(image))
        if self.policy is not None and self.policy.active:
            row = self.policy.draw(self.random.python)
            pixels = (
                self.policy.apply_loader(pixels.permute(2, 0, 1), row).permute(1, 2, 0).contiguous()
            )
        return (pixels, step_len) if self.train else pixels


class NativeCollate:
    """Loader samples (uint8 H x W x 3 image, label) -> (uint8 `Patches`, labels in the batch's
    image order): one image to a sequence, or packed first-fit (`pack_images`), in sequences of the
    shortest of `seq_lens` that holds the batch's longest image."""

    def __init__(self, patch: int, seq_lens: Sequence[int], pack_images: bool = False):
        self.patch, self.seq_lens, self.pack_images = patch, sorted(seq_lens), pack_images

    def __call__(self, samples: Sequence[tuple]) -> tuple[Patches, torch.Tensor]:
        """`samples`: (image, label), or in training (image, label, its step's sequence length)."""
        # C, H, W views: `pack` cuts them into patches
        images = [s[0].permute(2, 0, 1) for s in samples]
        labels = torch.tensor([int(s[1]) for s in samples])
        lengths = [(im.shape[1] // self.patch) * (im.shape[2] // self.patch) for im in images]
        # the step's length; else the shortest of `seq_lens` that holds the longest image
        seq_len = max((int(s[2]) for s in samples if len(s) > 2), default=0) or next(
            (n for n in self.seq_lens if n >= max(lengths)), max(lengths)
        )
        sequences = first_fit(lengths, seq_len) if self.pack_images else None
        batch = pack(images, self.patch, seq_len, sequences)
        order = [i for seq in sequences for i in seq] if sequences else list(range(len(images)))
        return batch, labels[order]


def first_fit(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """The items into sequences of `seq_len`: the largest first, each into the first sequence with
    room for it."""
    sequences: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        for k, free in enumerate(room):
            if n <= free:
                sequences[k].append(i)
                room[k] -= n
                break
        else:
            sequences.append([i])
            room.append(seq_len - n)
    return sequences


class NativeBatchSampler(TrainBatchSampler):
    """This DP rank's micro-batches of (index, epoch, sequence length) keys (module doc): step s of
    every epoch has the length `lens[s]` and `step_images[s]` images, a multiple of dp x
    grad_accum."""

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        base_len: int,
        seq_lens: Sequence[int],
        dp_rank: int,
        dp_size: int,
        grad_accum: int = 1,
        seed: int = 0,
        packed: bool = False,
    ):
        super().__init__(num_samples, global_batch, dp_rank, dp_size, grad_accum, seed)
        unit = dp_size * grad_accum
        budget = global_batch * base_len
        self.seq_lens = sorted(int(n) for n in seq_lens)
        # images a step: the same under every layout where budget / n is a multiple of dp x
        # grad_accum (docs)
        per_len = {n: step_images(budget, n, packed, unit) for n in self.seq_lens}
        # the lengths: the seed's alone, every epoch alike
        rng = np.random.default_rng([seed, 0x6E617469])
        lens, images, used = [], [], 0
        while True:
            # the lengths whose step the rest of the epoch still fills: a step of many short
            # sequences that no longer fits gives way to longer ones (fewer images), so that a small
            # set leaves out less than one step's worth (122 images at batch 32: 16 left, not 58)
            fitting = [n for n in self.seq_lens if used + per_len[n] <= num_samples]
            if not fitting:
                break
            n = int(rng.choice(fitting))
            lens.append(n)
            images.append(per_len[n])
            used += per_len[n]
        if not lens:
            raise ValueError(
                f"the training set has {num_samples} samples, fewer than one native step's "
                f"{max(per_len.values())}: lower data.batch_size"
            )
        self.lens, self.step_images = lens, images
        self.starts = np.concatenate([[0], np.cumsum(images)])
        self.steps_per_epoch = len(lens)
        self.dropped_per_epoch = num_samples - used
        self.tokens_per_step = budget

    def images(self, first: int, last: int) -> int:
        """The images of the run's steps first + 1 .. last (counted from 1), over all ranks."""
        whole, start = divmod(first, self.steps_per_epoch)
        end_whole, end = divmod(last, self.steps_per_epoch)
        per_epoch = int(self.starts[-1])
        return int((end_whole - whole) * per_epoch + self.starts[end] - self.starts[start])

    def global_batches(self, epoch: int) -> list[np.ndarray]:
        order = self.order(epoch)
        return [order[self.starts[s] : self.starts[s + 1]] for s in range(self.steps_per_epoch)]

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.grad_accum

    # a key here also carries its step's sequence length: (index, epoch, seq_len)
    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:  # type: ignore[override]
        epoch = self.epoch
        batches = self.global_batches(epoch)
        for step in range(self.start_step, self.steps_per_epoch):
            local = self.step_images[step] // self.dp_size
            micro = local // self.grad_accum
            mine = batches[step][self.dp_rank * local : (self.dp_rank + 1) * local]
            for a in range(self.grad_accum):
                yield [(int(i), epoch, self.lens[step]) for i in mine[a * micro : (a + 1) * micro]]
