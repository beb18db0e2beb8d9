"""A packed split as a map-style dataset: the same samples, labels and transform as `ImageFolder`, each image read
at its offset in its shard (fetched first where the shards are remote)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from torch.utils.data import Dataset

from visiondist.data.decode import decode_rgb
from visiondist.data.robust import BadImages
from visiondist.data.shards.pack import FORMAT, VERSION
from visiondist.data.shards.store import ShardError, ShardStore


def read_meta(store: ShardStore) -> dict:
    """dataset.json of a packed data set; ShardError naming the fix when it is not one."""
    try:
        meta = json.loads(store.read_small("dataset.json"))
    except json.JSONDecodeError as exc:
        raise ShardError(f"{store.url('dataset.json')} is not JSON ({exc})") from None
    if meta.get("format") != FORMAT:
        raise ShardError(f"data.root={store.root} is not a packed data set (its dataset.json was not written by "
                         "tools/data.py pack): pack it (python tools/data.py pack data=<its config> out=DIR) and train "
                         "from DIR, or drop data.format=shards to read it as a tree")
    if meta.get("version", 0) > VERSION:
        raise ShardError(f"{store.url('dataset.json')} is format version {meta['version']}; this visiondist reads "
                         f"up to {VERSION}: upgrade visiondist")
    return meta


class PackedImages:
    """A packed split's index: each sample's shard, byte offset and length (and `labels`: its class, or for
    detection its COCO image id), read through the data set's store."""

    def __init__(self, store: ShardStore, split: str, meta: dict):
        if split not in meta["splits"]:
            raise ShardError(f"{store.url('dataset.json')} has no split {split!r} (it has "
                             f"{', '.join(meta['splits'])}): set data.train_split / data.val_split")
        self.store, self.split = store, split
        self.entry = json.loads(store.read_small(f"{split}.json"))
        self.shards = self.entry["shardlist"]
        index = store.local(self.entry["index"], self.entry["index_sha256"], self.entry["index_size"])
        with np.load(io.BytesIO(index.read_bytes())) as arrays:
            self.labels, self.shard, self.offset, self.length = (
                arrays[k] for k in ("label", "shard", "offset", "length"))
        self.shard_starts = np.concatenate([[0], np.cumsum([s["nsamples"] for s in self.shards])])

    def __len__(self) -> int:
        return len(self.labels)

    def name(self, index: int) -> str:
        """Where a sample lives, for messages: `<shard>#<key>`."""
        return f"{self.store.url(self.shards[int(self.shard[index])]['url'])}#{index:09d}"

    def image_bytes(self, index: int) -> bytes:
        s = self.shards[int(self.shard[index])]
        return self.store.read(s["url"], s["sha256"], s["filesize"], int(self.offset[index]), int(self.length[index]))

    def file(self, key: str) -> Path:
        """A file of the split's entry (e.g. `annotations`), local: in place or fetched (SHA-256 checked)."""
        return self.store.local(self.entry[key], self.entry[f"{key}_sha256"], self.entry[f"{key}_size"])


def key_of(name: str) -> int:
    """The sample index of a `PackedImages.name`."""
    return int(name.rsplit("#", 1)[1])


class ShardSplit(Dataset):
    """Indexed by an int or by a `(index, epoch)` key, as `ImageFolder`. In training an unreadable image is replaced
    by the next readable image of its class (`visiondist.data.robust`); in evaluation it is an error."""

    def __init__(self, store: ShardStore, split: str, transform: Optional[Callable] = None, train: bool = False,
                 max_bad_images: int = 10, reader: Optional[Callable] = None, meta: Optional[dict] = None):
        self.store, self.split = store, split
        self.meta = meta or read_meta(store)
        self.packed = PackedImages(store, split, self.meta)
        self.root = store.url(f"{split}.json")
        self.targets, self.shard, self.shard_starts = self.packed.labels, self.packed.shard, self.packed.shard_starts
        self.offset, self.length, self.shards = self.packed.offset, self.packed.length, self.packed.shards
        self.classes = list(self.meta["classes"])
        self.transform = transform
        self.decode = reader or decode_rgb  # `device_decode.encoded_or_decoded` under data.decode_on=device
        self._bad = BadImages(max_bad_images, train)
        self._by_class = np.argsort(self.targets, kind="stable")  # replacements: the rest of the class, in order
        self._rank_in_class = np.empty_like(self._by_class)
        self._rank_in_class[self._by_class] = np.arange(len(self._by_class))
        self._class_start = np.searchsorted(self.targets[self._by_class], np.arange(len(self.classes)))
        self._class_size = np.bincount(self.targets, minlength=len(self.classes))

    def __len__(self) -> int:
        return len(self.targets)

    def name(self, index: int) -> str:
        return self.packed.name(index)

    def image_bytes(self, index: int) -> bytes:
        return self.packed.image_bytes(index)

    def _candidates(self, index: int):
        label = int(self.targets[index])
        start, size = int(self._class_start[label]), int(self._class_size[label])
        first = int(self._rank_in_class[index]) - start
        for k in range(size):
            i = int(self._by_class[start + (first + k) % size])
            yield i, self.name(i)

    def _read(self, name: str):
        return self.decode(self.image_bytes(key_of(name)), name)

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        _, image = self._bad.read(self._candidates(index), self._read)
        label = int(self.targets[index])
        if self.transform is None:
            return image, label
        out = self.transform(image, index, epoch)
        if isinstance(out, tuple):
            return out[0], label, out[1]
        return out, label

