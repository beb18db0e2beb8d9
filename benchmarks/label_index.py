"""The label index of a user's YOLO set at scale: labels indexed a second, cold and cached, against
a plain loop that reads every file.

A YOLO set of `--labels` images is generated (each image a hard link to one of a few small JPEGs;
each label file 1-6 boxes, 1 in 20 images without one), then timed, each in a fresh cache:
- `plain loop`: one process opens each image for its size (PIL, the header alone) and reads and
  splits each label file: the least any index does, with no checks and nothing written;
- `index, 1 process` and `index, N processes`: `visiondist.data.formats` building the split's COCO
  index (every line checked, pixel boxes, the COCO file and its record written to the cache), in
  one process and in the launching process's pool (every CPU it may use, what a run uses);
- `cached`: the same call again, files unchanged: the names, sizes and modification times of the
  images and label files stat'ed, the index read from the cache.

    python benchmarks/label_index.py                    # 100,000 labels, in a temporary folder
    python benchmarks/label_index.py --labels 1000000 --work /data/tmp
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PIL import Image

from visiondist.data.formats.index_cache import Recognised, cache_folder, cached_index, inputs_of
from visiondist.data.formats.labels import default_workers, index_yolo
from visiondist.data.formats.yolo import list_images, read_yaml

LINKS = 50_000  # hard links to one JPEG
NAMES = ["person", "car", "dog", "cat", "bicycle", "bus"]


def generate(root: Path, count: int, seed: int = 0) -> Path:
    """A YOLO set of `count` train images (hard links to one JPEG) and their label files; returns
    its data.yaml."""
    rng = random.Random(seed)
    images, labels = root / "images" / "train", root / "labels" / "train"
    images.mkdir(parents=True)
    labels.mkdir(parents=True)
    for i in range(count):
        name = f"{i:07d}"
        if i % LINKS == 0:  # a file system allows so many links to one file
            one = root / f"one_{i // LINKS}.jpg"
            Image.new("RGB", (64, 48), (90, 120, 30)).save(one, quality=80)
        os.link(one, images / f"{name}.jpg")
        if i % 20 == 19:  # an image without objects
            continue
        lines = []
        for _ in range(rng.randint(1, 6)):
            w, h = rng.uniform(0.05, 0.5), rng.uniform(0.05, 0.5)
            cx, cy = rng.uniform(w / 2, 1 - w / 2), rng.uniform(h / 2, 1 - h / 2)
            lines.append(f"{rng.randrange(len(NAMES))} {cx:.6f} {cy:.6f} {w:.6f} {h:.6f}")
        (labels / f"{name}.txt").write_text("\n".join(lines) + "\n")
    yaml_file = root / "data.yaml"
    yaml_file.write_text(f"path: {root}\ntrain: images/train\nval: images/train\nnames: {NAMES}\n")
    return yaml_file


def plain_loop(root: Path) -> int:
    """Every image's size and every label file's numbers, in one process; returns the boxes."""
    boxes = 0
    for image in sorted((root / "images" / "train").iterdir()):
        with Image.open(image) as im:
            im.size  # noqa: B018 (the header read)
        label = root / "labels" / "train" / f"{image.stem}.txt"
        if label.is_file():
            boxes += sum(1 for line in label.read_text().splitlines() if len(line.split()) == 5)
    return boxes


def timed(function) -> tuple[float, object]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--labels", type=int, default=100_000, help="images (and label files)")
    ap.add_argument("--work", default=None, help="where the set is written (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work, prefix="label-index-") as work:
        root = Path(work) / "set"
        seconds, yaml_file = timed(lambda: generate(root, args.labels))
        print(f"generated {args.labels} images and their labels in {seconds:.1f} s", flush=True)
        os.environ["XDG_CACHE_HOME"] = str(Path(work) / "cache")
        dataset = read_yaml(yaml_file)
        recognised = Recognised("yolo", yaml_file, "a YOLO set (data.yaml)")
        workers = default_workers()
        rows = []
        seconds, boxes = timed(lambda: plain_loop(root))
        rows.append(("plain loop (sizes and label files read, 1 process)", seconds, boxes))

        def index(n: int, cached: bool = False) -> dict:
            """What a run's start does for the split: list it, stat its files, build or reuse."""
            images = list_images(dataset.splits["train"])

            def build():
                if cached:
                    sys.exit("the cache was not used")
                return index_yolo(dataset, "train", root / "images", n, images)

            inputs = inputs_of(recognised, "train", images)
            return cached_index(recognised, "train", build, inputs)[1]

        for n in sorted({1, workers}):
            for stale in cache_folder(recognised).glob("*.json"):
                stale.unlink()
            seconds, record = timed(lambda n=n: index(n))
            what = f"index, {n} process{'es' if n > 1 else ''} (cold)"
            rows.append((what, seconds, record["counts"]["boxes"]))
        seconds, record = timed(lambda: index(workers, cached=True))
        what = "index, cached (files listed and stat'ed, index read)"
        rows.append((what, seconds, record["counts"]["boxes"]))
    plain = rows[0][1]
    print(f"\n{args.labels} label files, {os.cpu_count()} CPUs ({workers} usable)\n")
    print("| path | seconds | labels / s | against the plain loop | boxes |")
    print("| --- | --- | --- | --- | --- |")
    for what, seconds, count in rows:
        print(
            f"| {what} | {seconds:.2f} | {args.labels / seconds:,.0f} | {plain / seconds:.2f}x "
            f"| {count:,} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
