"""A packed split as a map-style dataset: the same samples, labels and transform as `ImageFolder`,
each image read at its offset in its shard (fetched first where the shards are remote)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from visiondist.data.decode import decode_rgb
from visiondist.data.imagefolder import LabelledImages
from visiondist.data.robust import BadImages
from visiondist.data.shards.pack import VERSION
from visiondist.data.shards.store import FORMAT, ShardError, ShardStore


def read_meta(store: ShardStore) -> dict:
    """dataset.json of a packed data set; ShardError naming the fix when it is not one.

    Args:
        store: the data set's store.

    Returns:
        dataset.json's contents.
    """
    try:
        meta = json.loads(store.read_small("dataset.json"))
    except json.JSONDecodeError as exc:
        raise ShardError(f"{store.url('dataset.json')} is not JSON ({exc})") from None
    if meta.get("format") != FORMAT:
        raise ShardError(
            f"data.root={store.root} is not a packed data set (its dataset.json was not written "
            "by tools/data.py pack): pack it (python tools/data.py pack data=<its config> "
            "out=DIR) and train from DIR, or read it as a tree with data.format=imagefolder (class "
            "folders) or data.format=auto (detection data)"
        )
    if meta.get("version", 0) > VERSION:
        raise ShardError(
            f"{store.url('dataset.json')} is format version {meta['version']}; this visiondist "
            f"reads up to {VERSION}: upgrade visiondist"
        )
    return meta


class PackedImages:
    """A packed split's index: each sample's shard, byte offset and length (and `labels`: its class,
    or for detection its COCO image id), read through the data set's store."""

    def __init__(self, store: ShardStore, split: str, meta: dict):
        if split not in meta["splits"]:
            raise ShardError(
                f"{store.url('dataset.json')} has no split {split!r} (it has "
                f"{', '.join(meta['splits'])}): set data.train_split / data.val_split"
            )
        self.store, self.split = store, split
        self.entry = json.loads(store.read_small(f"{split}.json"))
        self.shards = self.entry["shardlist"]
        index = store.local(
            self.entry["index"], self.entry["index_sha256"], self.entry["index_size"]
        )
        with np.load(io.BytesIO(index.read_bytes())) as arrays:
            self.labels, self.shard, self.offset, self.length = (
                arrays[k] for k in ("label", "shard", "offset", "length")
            )
        self.shard_starts = np.concatenate([[0], np.cumsum([s["nsamples"] for s in self.shards])])

    def __len__(self) -> int:
        return len(self.labels)

    def name(self, index: int) -> str:
        """Where a sample lives, for messages: `<shard>#<key>`."""
        return f"{self.store.url(self.shards[int(self.shard[index])]['url'])}#{index:09d}"

    def image_bytes(self, index: int) -> bytes:
        s = self.shards[int(self.shard[index])]
        return self.store.read(
            s["url"], s["sha256"], s["filesize"], int(self.offset[index]), int(self.length[index])
        )

    def file(self, key: str) -> Path:
        """A file of the split's entry (e.g. `annotations`), local: in place or fetched (SHA-256
        checked)."""
        return self.store.local(
            self.entry[key], self.entry[f"{key}_sha256"], self.entry[f"{key}_size"]
        )


def key_of(name: str) -> int:
    """The sample index of a `PackedImages.name`."""
    return int(name.rsplit("#", 1)[1])


class ShardSplit(LabelledImages):
    """A packed classification split, read as `ImageFolder` reads a tree.

    The same keys, replacements and transform; `packed` is its index.

    Args:
        store: the packed data set's store.
        split: the split's name.
        transform: the sample transform (image, index, epoch) -> sample; None: the decoded image.
        train: a training split: an unreadable image is replaced (else an error).
        max_bad_images: the unreadable images a training run tolerates.
        reader: (bytes, name) -> image; default `decode_rgb` (under data.decode_on=device,
            `device_decode.encoded_or_decoded`).
        meta: the data set's dataset.json when already read.
    """

    def __init__(
        self,
        store: ShardStore,
        split: str,
        transform: Optional[Callable] = None,
        train: bool = False,
        max_bad_images: int = 10,
        reader: Optional[Callable] = None,
        meta: Optional[dict] = None,
    ):
        self.store, self.split = store, split
        self.meta = meta or read_meta(store)
        self.packed = PackedImages(store, split, self.meta)
        self.root = store.url(f"{split}.json")
        self.targets, self.shard_starts = self.packed.labels, self.packed.shard_starts
        self.classes = list(self.meta["classes"])
        self.transform = transform
        # `device_decode.encoded_or_decoded` under data.decode_on=device
        self.decode = reader or decode_rgb
        self._bad = BadImages(max_bad_images, train)
        self._index_classes()  # shuffled when packed: replacements follow the class in index order

    def image_bytes(self, index: int) -> bytes:
        return self.packed.image_bytes(index)

    def _name(self, index: int) -> str:
        return self.packed.name(index)

    def _read(self, name: str):
        return self.decode(self.image_bytes(key_of(name)), name)


def check_listed(store: ShardStore, entry: dict) -> None:
    """A split of a pack in a directory: each file its index lists, there and of its size (a stat
    each), so that a copy cut short stops the launch, not the run at the shard's first read an
    epoch later. A URL's shards are checked as they are fetched (SHA-256)."""
    listed = [(s["url"], int(s["filesize"])) for s in entry.get("shardlist", [])]
    for key in ("index", "annotations"):
        if key in entry and f"{key}_size" in entry:
            listed.append((entry[key], int(entry[f"{key}_size"])))
    for name, size in listed:
        store.local_file(name, size)
