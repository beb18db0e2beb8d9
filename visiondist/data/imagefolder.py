"""ImageFolder-layout classification data (`<root>/<split>/<class>/<image>`): ImageNet and the built-in sets."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import cv2
import numpy as np
from torch.utils.data import Dataset

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


def read_rgb(path: str) -> np.ndarray:
    """Decode any common image file (grey, RGBA and CMYK included) to an HxWx3 uint8 RGB array."""
    data = np.fromfile(path, dtype=np.uint8)
    image = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    if image is None:
        raise OSError(f"cannot decode image {path}")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


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
    """Indexed by an int or by a `(index, epoch)` key; the key seeds the sample's augmentation."""

    def __init__(self, split_dir: str | os.PathLike, transform: Optional[Callable] = None):
        self.root = Path(split_dir)
        self.classes, self.samples = scan_image_folder(self.root)
        self.targets = np.array([label for _, label in self.samples], dtype=np.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        path, label = self.samples[index]
        image = read_rgb(path)
        if self.transform is not None:
            image = self.transform(image, index, epoch)
        return image, label
