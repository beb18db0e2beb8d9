"""What an ImageFolder index costs a rank and its loader workers: start-up time and memory of the index of a tree of
200,000 files (1,000 classes x 200, empty files: only the listing matters here), as a list of (path, label) tuples
(the previous index) and as arrays (`visiondist.data.index`), listed afresh and from the listing cache.

Each variant runs in its own process: it builds the index (timed; its growth of the process's resident memory is the
rank's cost), then forks 4 workers that each read every path once, as loader workers do over an epoch, and reports
what each worker copied of the parent's memory by reading (its private dirty memory, less that of a worker that
reads nothing).

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
    """The previous index: sorted class folders, then a list of (path, label) tuples and an int64 label array."""
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


def measure(variant: str, split: str) -> dict:
    """In this process: build the index `variant`, then fork the workers."""
    from visiondist.data.index import list_image_folder

    split_path = Path(split)
    before = _kb("VmRSS:")
    start = time.perf_counter()
    if variant == "tuples":
        samples, _ = _old_index(split_path)
        get, n = _TupleIndex(samples), len(samples)  # workers read samples[i][0], as the previous dataset did
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
    return {"variant": variant, "files": n, "build_s": round(seconds, 3), "rank_mb": round(rank_mb, 1),
            "copied_per_worker_mb": round(sum(copied) / len(copied), 1),
            "rank_plus_workers_mb": round(rank_mb + sum(copied), 1)}


class _TupleIndex:
    def __init__(self, samples):
        self.samples = samples

    def __getitem__(self, i):
        return self.samples[i][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--measure", nargs=2, metavar=("VARIANT", "SPLIT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        split = Path(tmp) / "train"
        t = time.perf_counter()
        _tree(split, args.files)
        print(f"{args.files} files in {time.perf_counter() - t:.1f} s; {WORKERS} workers each read every path",
              flush=True)
        env = {**os.environ, "XDG_CACHE_HOME": str(Path(tmp) / "cache")}
        rows = []
        for variant in ("tuples", "arrays, listed", "arrays, cache written", "arrays, from the cache"):
            out = subprocess.run([sys.executable, __file__, "--measure", variant, str(split)], env=env,
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    print("\n| index | start-up (s) | rank (MB) | copied per worker (MB) | rank + 4 workers (MB) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['build_s']} | {r['rank_mb']} | {r['copied_per_worker_mb']} | "
              f"{r['rank_plus_workers_mb']} |")


if __name__ == "__main__":
    main()
