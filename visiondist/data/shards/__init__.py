"""Packed shards (`data.format=shards`): `tools/data.py pack` writes them (`pack`), a directory or
an http(s) URL serves them (`store`: fetch, cache, checksums, bytes fetched), `dataset.ShardSplit`
reads a split as `ImageFolder` reads a tree (`packed_coco`: a COCO-format set packed, and read back
as `CocoDetection` reads it), and the train sampler's `streams` order makes each rank read about 1 /
ranks of the shards per epoch. May import visiondist.data's readers and robust reading; nothing
above the data package."""

from __future__ import annotations

import json
from typing import Optional

from visiondist.data.shards.dataset import ShardSplit, check_listed, read_meta
from visiondist.data.shards.store import ShardError, ShardStore

__all__ = ["ShardError", "ShardSplit", "ShardStore", "describe", "open_store", "read_meta"]


def open_store(d) -> ShardStore:
    """The store of a data config with `format: shards`.

    Args:
        d: the data config (`root`, and optionally `cache_dir`, `cache_gb`, `fetch_retries`).

    Returns:
        A `ShardStore`.
    """
    return ShardStore(
        str(d.root),
        cache_dir=d.get("cache_dir"),
        cache_gb=float(d.get("cache_gb", 100.0)),
        retries=int(d.get("fetch_retries", 3)),
    )


def describe(
    d, splits: list[str], need: Optional[int] = None, kind: Optional[str] = None
) -> tuple[int, str, str]:
    """A packed data set checked for a run, as the launcher reports it.

    (class count, where, "classes") of a packed data set, after checking it holds `kind` data
    ("classification" or "detection"), has `splits` and, for training, at least `need` training
    samples: a ShardError naming the fix otherwise.

    Args:
        d: the data config (format: shards).
        splits: the split names the run reads.
        need: the fewest training samples (one global batch); None: not checked.
        kind: "classification" or "detection"; None: not checked.

    Returns:
        The class count, where its dataset.json is (a URL or a path), and what was counted
        ("classes" or "categories").
    """
    store = open_store(d)
    meta = read_meta(store)
    if kind is not None and meta.get("kind") != kind:
        source, model = (
            (
                "a COCO-format set (data=coco, data=shapes_coco)",
                "a classifier (e.g. model=vit_tiny)",
            )
            if kind == "detection"
            else (
                "an image folder (data=imagenet, data=shapes)",
                "a detector (e.g. model=fasterrcnn_mobilenet_v3)",
            )
        )
        raise ShardError(
            f"data.root={d.root} holds packed {meta.get('kind')} data but the model needs {kind} "
            f"data: train {model} on it, or pack {source}"
        )
    for split in splits:
        if split not in meta["splits"]:
            key = "train_split" if split == d.train_split else "val_split"
            raise ShardError(
                f"data.root={d.root} has no packed split {split!r} (it has "
                f"{', '.join(meta['splits'])}): set data.{key}"
            )
        # its shard list: a pack cut short lacks it
        entry = json.loads(store.read_small(f"{split}.json"))
        if not store.remote:
            check_listed(store, entry)
    if need is not None and meta["splits"][d.train_split]["samples"] < need:
        raise ShardError(
            f"data.root={d.root}: the training split has "
            f"{meta['splits'][d.train_split]['samples']} samples, fewer than one global batch "
            f"data.batch_size={need}: lower data.batch_size"
        )
    return (
        len(meta["classes"]),
        store.url("dataset.json"),
        ("categories" if meta.get("kind") == "detection" else "classes"),
    )
