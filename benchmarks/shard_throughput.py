"""Reading packed shards against reading the tree, on real photographs, per CPU core; and the bytes
each rank fetches per epoch from a server.

The data: `benchmarks/photos.py`'s photographs (scikit-image's, cut at ImageNet's sizes, ~450 x 380
px, JPEG q90-95) as an ImageFolder tree, packed by `tools/data.py pack`'s code twice: as they are,
and re-encoded with the longer side at most 320 px (JPEG q90; FFCV stores ImageNet at 256-512 px to
cut decoding). Each is read through a real `DataLoader` with one worker pinned to one core
(`--core`), the shipped classification transform (224 px crops and flips, the default recipe),
batches of 64, in alternating rounds; medians of the rounds.

Then, from a loopback HTTP server, one epoch of the train sampler's order at 1, 2 and 4 ranks, each
rank with its own cache (a node each): the bytes each rank fetched, against all the train shards
(data.streams=8, batch 64).

    python benchmarks/shard_throughput.py                  # 640 photos, 5 rounds, worker on core 1
    python benchmarks/shard_throughput.py --images 1280 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import cv2
import torch
from data_throughput import _pin, rate
from input_recipe import BATCH, SIZE, recipe_cfg
from photos import build_photos
from torch.utils.data import DataLoader

from visiondist.data.imagefolder import ImageFolder
from visiondist.data.sampler import TrainBatchSampler
from visiondist.data.shards import ShardSplit, ShardStore
from visiondist.data.shards.pack import PackOptions, pack_image_folder
from visiondist.data.transforms import ClassificationTransform


def loaders(tree: Path, packed: dict[str, Path], core: int) -> dict[str, DataLoader]:
    transform = ClassificationTransform(recipe_cfg("none"), True, SIZE, seed=0)
    sets = {"tree (ImageFolder)": ImageFolder(tree / "train", transform)}
    for name, root in packed.items():
        sets[name] = ShardSplit(ShardStore(str(root)), "train", transform)
    n = len(sets["tree (ImageFolder)"])
    keys = [(i, 0) for i in range(n)]
    order = [keys[i : i + BATCH] for i in range(0, n - BATCH + 1, BATCH)]
    return {
        name: DataLoader(
            ds,
            batch_sampler=order,
            num_workers=1,
            worker_init_fn=_pin(core),
            prefetch_factor=2,
            persistent_workers=True,
        )
        for name, ds in sets.items()
    }


def rounds(loaders_: dict[str, DataLoader], count: int) -> dict[str, float]:
    for loader in loaders_.values():  # warm-up: the workers start, the page cache holds the files
        rate(loader)
    seen: dict[str, list[float]] = {name: [] for name in loaders_}
    names = list(loaders_)
    for r in range(count):
        for name in names if r % 2 == 0 else reversed(names):
            seen[name].append(rate(loaders_[name]))
    return {name: round(statistics.median(v)) for name, v in seen.items()}


def fetched_per_rank(packed: Path, ranks: int, tmp: Path) -> list[int]:
    """Bytes each of `ranks` ranks (each its own node and cache) fetches over one epoch from a
    loopback server."""
    from shard_server import serve

    with serve(packed) as url:
        counts = []
        for rank in range(ranks):
            split = ShardSplit(
                ShardStore(url, cache_dir=str(tmp / f"cache{ranks}-{rank}")), "train"
            )
            index_bytes = split.store.fetched.value
            sampler = TrainBatchSampler(
                len(split), BATCH, rank, ranks, streams=8, shard_starts=split.shard_starts
            )
            for micro in sampler:
                for i, _ in micro:
                    split.image_bytes(i)
            counts.append(split.store.fetched.value - index_bytes)
        return counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=640)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--core", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    os.sched_setaffinity(0, (os.sched_getaffinity(0) - {args.core}) or os.sched_getaffinity(0))
    result: dict = {"core": args.core, "rounds": args.rounds}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        result["data"] = build_photos(root / "tree", args.images)
        packed = {"shards": root / "shards", "shards, re-encoded at 320 px": root / "shards320"}
        for (name, out), max_side in zip(packed.items(), (None, 320)):
            meta = pack_image_folder(
                root / "tree",
                ["train"],
                out,
                PackOptions(shard_mb=2, max_side=max_side, progress=False),
            )
            result.setdefault("packs", {})[name] = meta["splits"]["train"]
        result["images_per_s"] = rounds(loaders(root / "tree", packed, args.core), args.rounds)
        total = result["packs"]["shards"]["bytes"]
        result["fetched"] = {}
        for ranks in (1, 2, 4):
            counts = fetched_per_rank(packed["shards"], ranks, root)
            result["fetched"][ranks] = {
                "per_rank_mb": [round(c / 1e6, 1) for c in counts],
                "share_of_train_shards": [round(c / total, 2) for c in counts],
            }
    print(json.dumps(result, indent=1))
    print(
        f"\n{args.images} photos ({result['data']['mean_width']} x "
        f"{result['data']['mean_height']} px, {result['data']['mean_kb']} KB), one worker on core "
        f"{args.core}, {SIZE} px crops, batch {BATCH}, median of {args.rounds} alternating "
        "rounds\n\n| read from | images/s per core | train bytes (MB) |\n|---|---|---|"
    )
    base = result["images_per_s"]["tree (ImageFolder)"]
    sizes = {
        "tree (ImageFolder)": result["packs"]["shards"]["bytes"],
        **{k: v["bytes"] for k, v in result["packs"].items()},
    }
    for name, value in result["images_per_s"].items():
        print(f"| {name} | {value} ({value / base:.2f}x) | {sizes[name] / 1e6:.1f} |")
    print(
        "\n| ranks (a node each) | MB fetched per rank in one epoch | share of the train shards "
        "|\n|---|---|---|"
    )
    for ranks, row in result["fetched"].items():
        print(
            f"| {ranks} | {', '.join(map(str, row['per_rank_mb']))} | "
            f"{', '.join(map(str, row['share_of_train_shards']))} |"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
