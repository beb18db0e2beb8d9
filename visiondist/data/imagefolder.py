"""ImageFolder-layout classification data (`<root>/<split>/<class>/<image>`): ImageNet and the
built-in sets. Images are decoded by `visiondist.data.decode.read_rgb`, the reader every loader
shares."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from torch.utils.data import Dataset

from visiondist.data.decode import read_rgb  # the one reader (imported from here too)
from visiondist.data.index import IMG_EXTENSIONS, list_image_folder  # noqa: F401  (IMG_EXTENSIONS: from here too)
from visiondist.data.robust import BadImages


def scan_image_folder(split_dir: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """Classes (sorted sub-folder names) and (path, label) samples, as a list (for small trees and
    tests; the dataset keeps `visiondist.data.index`'s arrays); an empty class folder is an
    error."""
    classes, paths, labels = list_image_folder(split_dir, cache=False)
    return classes, [(paths[i], int(labels[i])) for i in range(len(paths))]


class LabelledImages(Dataset):
    """What `ImageFolder` and a packed split (`visiondist.data.shards.ShardSplit`) share: indexed by
    an int or by a `(index, epoch)` key (the key seeds the sample's augmentation); in training an
    unreadable image is replaced by the next readable image of its class (`visiondist.data.robust`),
    in evaluation it is an error. A subclass sets `targets`, `classes`, `transform` and `_bad`,
    calls `_index_classes()`, and says how a sample is named and read (`_name`, `_read`)."""

    targets: np.ndarray  # each sample's label
    classes: list[str]
    transform: Optional[Callable]
    _bad: BadImages

    def _index_classes(self) -> None:
        """Each class's samples in index order, for the replacements: the class's run when the
        samples are grouped by class (a tree's listing), else a stable sort by label (a shuffled
        pack)."""
        grouped = bool(np.all(self.targets[1:] >= self.targets[:-1]))
        self._by_class = None if grouped else np.argsort(self.targets, kind="stable")
        if self._by_class is not None:
            self._rank_in_class = np.empty_like(self._by_class)
            self._rank_in_class[self._by_class] = np.arange(len(self._by_class))
        in_order = self.targets if grouped else self.targets[self._by_class]
        self._class_start = np.searchsorted(in_order, np.arange(len(self.classes)))
        self._class_size = np.bincount(self.targets, minlength=len(self.classes))

    def __len__(self) -> int:
        return len(self.targets)

    def _name(self, index: int) -> str:
        raise NotImplementedError

    def _read(self, name: str):
        raise NotImplementedError

    def _candidates(self, index: int):
        """(index, name) of the sample, then of the rest of its class in order, wrapping round."""
        label = int(self.targets[index])
        start, size = int(self._class_start[label]), int(self._class_size[label])
        first = (index if self._by_class is None else int(self._rank_in_class[index])) - start
        for k in range(size):
            i = start + (first + k) % size
            i = i if self._by_class is None else int(self._by_class[i])
            yield i, self._name(i)

    def __getitem__(self, key):
        # more: a native step's sequence length
        index, epoch, *more = key if isinstance(key, tuple) else (key, 0)
        _, image = self._bad.read(self._candidates(index), self._read)
        label = int(self.targets[index])
        if self.transform is None:
            return image, label
        out = self.transform(image, index, epoch, *more)
        # (image, augmentation parameters): see `visiondist.data.augment`
        if isinstance(out, tuple):
            return out[0], label, out[1]
        return out, label


class ImageFolder(LabelledImages):
    """An ImageFolder tree's split (`<split>/<class>/<image>`), its index in arrays
    (`visiondist.data.index`)."""

    def __init__(
        self,
        split_dir: str | os.PathLike,
        transform: Optional[Callable] = None,
        train: bool = False,
        max_bad_images: int = 10,
        reader: Optional[Callable] = None,
    ):
        self.root = Path(split_dir)
        # `visiondist.data.device_decode.read_encoded` under data.decode_on=device
        self.reader = reader or read_rgb
        # arrays: see visiondist.data.index
        self.classes, self.paths, self.targets = list_image_folder(self.root)
        self.transform = transform
        self._bad = BadImages(max_bad_images, train)
        # samples are grouped by class: a sample's replacements are the rest of its class
        self._index_classes()

    @property
    def samples(self) -> list[tuple[str, int]]:
        """(path, label) of every image, as torchvision's ImageFolder has them: a list built on each
        call (the index itself is `paths` and `targets`)."""
        return [(self.paths[i], int(self.targets[i])) for i in range(len(self.paths))]

    def _name(self, index: int) -> str:
        return self.paths[index]

    def _read(self, name: str):
        return self.reader(name)
