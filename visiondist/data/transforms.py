"""Image transforms (albumentations + OpenCV: the fastest CPU path we measured) and per-sample seeding."""

from __future__ import annotations

import albumentations as A
import numpy as np
import torch
from albumentations.pytorch import ToTensorV2


def classification_transforms(cfg, train: bool, size: int) -> A.Compose:
    """Train: random-resized crop + flip; eval: resize the short side to size / crop_pct, centre crop. `size` is the
    model's input resolution."""
    normalize = [A.Normalize(mean=tuple(cfg.mean), std=tuple(cfg.std)), ToTensorV2()]
    if train:
        steps = [A.RandomResizedCrop(size=(size, size), scale=tuple(cfg.train_crop_scale))]
        if cfg.hflip > 0:
            steps.append(A.HorizontalFlip(p=cfg.hflip))
    else:
        steps = [A.SmallestMaxSize(max_size=int(round(size / cfg.crop_pct))), A.CenterCrop(size, size)]
    return A.Compose(steps + normalize)


class SeededTransform:
    """Runs an albumentations pipeline with its RNG reset from a per-sample seed.

    The augmentation a sample gets then depends on (seed, epoch, index) only: not on the rank, the worker or the order
    in which samples are loaded. Runs with different layouts see identical pixels.
    """

    def __init__(self, transform: A.Compose, seed: int):
        self.transform, self.seed = transform, seed

    def __call__(self, image: np.ndarray, index: int, epoch: int) -> torch.Tensor:
        state = np.random.SeedSequence([self.seed, epoch, index]).generate_state(1)[0]
        self.transform.set_random_seed(int(state))
        return self.transform(image=image)["image"]
