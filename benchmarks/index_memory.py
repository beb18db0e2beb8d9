"""What a data set's index costs a rank and its loader workers: start-up time and memory of the
index of an ImageFolder tree of 200,000 files (1,000 classes x 200, empty files: only the listing
matters here), as a list of (path, label) tuples (the previous index) and as arrays
(`visiondist.data.index`), listed afresh and from the listing cache; as a packed split's index
(`data.format=shards`: 200 shards of 1,000, an index of arrays; written here without image bytes,
which its start-up does not read); and of a COCO annotation file of 50,000 images with 7 boxes each,
as record objects with pycocotools' COCO kept (the previous index) and as arrays
(`visiondist.data.coco.CocoIndex`).

Each variant runs in its own process: it builds the index (timed; its growth of the process's
resident memory is the rank's cost), then forks 4 workers that each read every path once, as loader
workers do over an epoch, and reports what each worker copied of the parent's memory by reading (its
private dirty memory, less that of a worker that reads nothing).

    python benchmarks/index_memory.py                 # 200,000 files in a temporary folder
    python benchmarks/index_memory.py --files 50000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKERS = 4


def _tree(root: Path, files: int, classes: int = 1000) -> None:
    per = files // classes
    for c in range(classes):
        folder = root / f"n{c:08d}"
        folder.mkdir(parents=True)
        for i in range(per):
            (folder / f"n{c:08d}_{i:06d}.JPEG").touch()
    old = time.time_ns() - 60_000_000_000
    for c in range(classes):
        os.utime(root / f"n{c:08d}", ns=(old, old))


def _kb(field: str, path: str = "/proc/self/status") -> int:
    for line in open(path):
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _old_index(split: Path):
    """The previous index: sorted class folders, then a list of (path, label) tuples and an int64
    label array."""
    import numpy as np

    classes = sorted(e.name for e in os.scandir(split) if e.is_dir())
    samples = []
    for label, name in enumerate(classes):
        files = sorted(e.name for e in os.scandir(split / name) if e.is_file())
        samples.extend((str(split / name / f), label) for f in files)
    return samples, np.array([label for _, label in samples], dtype=np.int64)


def _reader(index, n: int, read: bool, queue) -> None:
    if read:
        total = 0
        for i in range(n):
            total += len(index[i])
    queue.put(_kb("Private_Dirty:", "/proc/self/smaps_rollup"))


def _coco_tree(root: Path, images: int, boxes: int = 7) -> Path:
    """A COCO annotation file of `images` images with `boxes` boxes each (files need not exist: only
    the index)."""
    import random

    r = random.Random(0)
    anns, k = [], 0
    for i in range(1, images + 1):
        for _ in range(boxes):
            k += 1
            anns.append(
                {
                    "id": k,
                    "image_id": i,
                    "category_id": r.randint(1, 80),
                    "iscrowd": 0,
                    "area": 400.0,
                    "bbox": [
                        r.uniform(0, 400),
                        r.uniform(0, 300),
                        r.uniform(5, 200),
                        r.uniform(5, 200),
                    ],
                }
            )
    data = {
        "images": [
            {"id": i, "file_name": f"{i:012d}.jpg", "width": 640, "height": 480}
            for i in range(1, images + 1)
        ],
        "annotations": anns,
        "categories": [{"id": c, "name": f"c{c}"} for c in range(1, 81)],
    }
    path = root / "instances_train.json"
    path.write_text(json.dumps(data))
    return path


class _Records:
    """The previous COCO index: a list of record objects, pycocotools' COCO object kept beside
    it."""

    def __init__(self, ann_file: Path):
        from visiondist.data.coco_records import load_coco, read_records

        self.coco = load_coco(ann_file)
        self.records = read_records(self.coco, ann_file.parent, train=True)[0]

    def __getitem__(self, i):
        r = self.records[i]
        return (str(r.path), r.boxes, r.labels)


class _Arrays:
    def __init__(self, ann_file: Path):
        from visiondist.data.coco import CocoDetection

        self.index = CocoDetection(ann_file.parent, ann_file, train=True).index

    def __getitem__(self, i):
        r = self.index.record(i)
        return (str(r.path), r.boxes, r.labels)


def measure(variant: str, split: str) -> dict:
    """In this process: build the index `variant`, then fork the workers."""
    from visiondist.data.index import list_image_folder

    split_path = Path(split)
    before = _kb("VmRSS:")
    start = time.perf_counter()
    if variant == "tuples":
        samples, _ = _old_index(split_path)
        # workers read samples[i][0], as the previous dataset did
        get, n = _TupleIndex(samples), len(samples)
    elif variant == "shards":
        from visiondist.data.shards import ShardSplit, ShardStore

        dataset = ShardSplit(ShardStore(split), "train")
        # workers look up each sample's shard, offset and length
        get, n = _ShardEntries(dataset), len(dataset)
    elif variant.startswith("COCO"):
        get = (_Records if "records" in variant else _Arrays)(split_path)
        n = len(get.records if hasattr(get, "records") else get.index)
    else:
        _, paths, labels = list_image_folder(split_path, cache=variant != "arrays, listed")
        get, n = paths, len(paths)
    seconds = time.perf_counter() - start
    rank_mb = (_kb("VmRSS:") - before) / 1024
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    private = []
    for read in (False,) + (True,) * WORKERS:
        p = ctx.Process(target=_reader, args=(get, n, read, queue))
        p.start()
        private.append(queue.get())
        p.join()
    idle, busy = private[0], private[1:]
    copied = [(b - idle) / 1024 for b in busy]
    return {
        "variant": variant,
        "files": n,
        "build_s": round(seconds, 3),
        "rank_mb": round(rank_mb, 1),
        "copied_per_worker_mb": round(sum(copied) / len(copied), 1),
        "rank_plus_workers_mb": round(rank_mb + sum(copied), 1),
    }


class _ShardEntries:
    def __init__(self, dataset):
        self.d = dataset

    def __getitem__(self, i):
        p = self.d.packed
        return p.shards[int(p.shard[i])]["url"], int(p.offset[i]), int(p.length[i])


def _fake_pack(root: Path, files: int, classes: int = 1000, per_shard: int = 1000) -> Path:
    """dataset.json, train.json and train-index.npz of a pack of `files` samples (no tars: the index
    is measured)."""
    import hashlib

    import numpy as np

    root.mkdir()
    labels = np.random.default_rng(0).integers(0, classes, files)
    shards = -(-files // per_shard)
    index = root / "train-index.npz"
    np.savez(
        index,
        label=labels.astype(np.int64),
        shard=(np.arange(files) // per_shard).astype(np.int32),
        offset=(np.arange(files) % per_shard * 110_000 + 512).astype(np.int64),
        length=np.full(files, 110_000, np.int64),
    )
    data = index.read_bytes()
    (root / "train.json").write_text(
        json.dumps(
            {
                "wids_version": 1,
                "shardlist": [
                    {
                        "url": f"train-{k:06d}.tar",
                        "nsamples": min(per_shard, files - k * per_shard),
                        "filesize": 1,
                        "sha256": "0" * 64,
                    }
                    for k in range(shards)
                ],
                "index": index.name,
                "index_sha256": hashlib.sha256(data).hexdigest(),
                "index_size": len(data),
            }
        )
    )
    (root / "dataset.json").write_text(
        json.dumps(
            {
                "format": "visiondist-shards",
                "version": 1,
                "kind": "classification",
                "classes": [f"n{c:08d}" for c in range(classes)],
                "splits": {"train": {"samples": files}},
            }
        )
    )
    return root


class _TupleIndex:
    def __init__(self, samples):
        self.samples = samples

    def __getitem__(self, i):
        return self.samples[i][0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument(
        "--coco-images", type=int, default=50_000, help="COCO rows: images of 7 boxes each"
    )
    parser.add_argument("--measure", nargs=2, metavar=("VARIANT", "SPLIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        split = Path(tmp) / "train"
        t = time.perf_counter()
        _tree(split, args.files)
        print(
            f"{args.files} files in {time.perf_counter() - t:.1f} s; {WORKERS} workers each read "
            "every path",
            flush=True,
        )
        env = {**os.environ, "XDG_CACHE_HOME": str(Path(tmp) / "cache")}
        coco = _coco_tree(Path(tmp), args.coco_images)
        packed = _fake_pack(Path(tmp) / "packed", args.files)
        rows = []
        for variant, where in (
            ("tuples", split),
            ("arrays, listed", split),
            ("arrays, cache written", split),
            ("arrays, from the cache", split),
            ("shards", packed),
            ("COCO records + pycocotools", coco),
            ("COCO arrays", coco),
        ):
            out = subprocess.run(
                [sys.executable, __file__, "--measure", variant, str(where)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    print(
        "\n| index | entries | start-up (s) | rank (MB) | copied per worker (MB) | rank + 4 "
        "workers (MB) |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['variant']} | {r['files']} | {r['build_s']} | {r['rank_mb']} | "
            f"{r['copied_per_worker_mb']} | {r['rank_plus_workers_mb']} |"
        )


if __name__ == "__main__":
    main()
