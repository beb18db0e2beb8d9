"""ImageFolder-layout classification data (`<root>/<split>/<class>/<image>`): ImageNet and the built-in sets. Images
are decoded by `visiondist.data.decode.read_rgb`, the reader every loader shares."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from torch.utils.data import Dataset

from visiondist.data.decode import read_rgb  # the one reader (imported from here too)
from visiondist.data.robust import BadImages

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def scan_image_folder(split_dir: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Classes (sorted sub-folder names) and (path, label) samples; an empty class folder is an error."""
    if not split_dir.is_dir():
        raise FileNotFoundError(f"{split_dir} does not exist: expected <root>/<split>/<class>/<images>")
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"{split_dir} has no class folders")
    samples = []
    for label, name in enumerate(classes):
        files = sorted(
            e.name for e in os.scandir(split_dir / name) if e.is_file() and e.name.lower().endswith(IMG_EXTENSIONS)
        )
        if not files:
            raise FileNotFoundError(f"class folder {split_dir / name} holds no images ({', '.join(IMG_EXTENSIONS)})")
        samples.extend((str(split_dir / name / f), label) for f in files)
    return classes, samples


class ImageFolder(Dataset):
    """Indexed by an int or by a `(index, epoch)` key; the key seeds the sample's augmentation.

    In training an unreadable image (missing, empty, truncated, not an image) is replaced by the next readable image
    of its class (`visiondist.data.robust`); in evaluation it is an error."""

    def __init__(self, split_dir: str | os.PathLike, transform: Optional[Callable] = None, train: bool = False,
                 max_bad_images: int = 10, reader: Optional[Callable] = None):
        self.root = Path(split_dir)
        self.reader = reader or read_rgb  # `visiondist.data.device_decode.read_encoded` under data.decode_on=device
        self.classes, self.samples = scan_image_folder(self.root)
        self.targets = np.array([label for _, label in self.samples], dtype=np.int64)
        self.transform = transform
        self._bad = BadImages(max_bad_images, train)
        # samples are grouped by class: a sample's replacements are the rest of its class, in order, wrapping round
        self._class_start = np.searchsorted(self.targets, np.arange(len(self.classes)))
        self._class_size = np.bincount(self.targets, minlength=len(self.classes))

    def __len__(self) -> int:
        return len(self.samples)

    def _candidates(self, index: int):
        label = self.targets[index]
        start, size = int(self._class_start[label]), int(self._class_size[label])
        for k in range(size):
            i = start + (index - start + k) % size
            yield i, self.samples[i][0]

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        _, image = self._bad.read(self._candidates(index), self.reader)
        label = int(self.targets[index])
        if self.transform is None:
            return image, label
        out = self.transform(image, index, epoch)
        if isinstance(out, tuple):  # (image, augmentation parameters): see `visiondist.data.augment`
            return out[0], label, out[1]
        return out, label
