"""Real photographs at ImageNet's sizes, for measuring the input path and for the GPU's end-to-end
training checks (no download: scikit-image ships the sources). `build_photos(root, count)` writes an
ImageFolder tree <root>/train/<photo>/NNNNN.JPEG (`split="val"`: <root>/val/...); `processes` > 1
writes in parallel, the same files."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "stereo_motorcycle")


def _sources() -> dict:
    from skimage import data

    sources = {}
    for name in PHOTOS:
        image = getattr(data, name)()
        image = image[0] if name == "stereo_motorcycle" else image
        # every source at least 440 px on its short side
        scale = max(1.0, 440 / min(image.shape[:2]))
        sources[name] = (
            cv2.resize(image, None, fx=scale, fy=scale, interpolation=cv2.INTER_CUBIC)
            if scale > 1
            else image
        )
    return sources


def _write(args) -> list[tuple[int, int, int]]:
    """Images `start`..`stop` of the set: each from its own generator (seed, index), so that any
    split of the work writes the same files."""
    root, split, seed, start, stop = args
    sources, sizes = _sources(), []
    for i in range(start, stop):
        rng = np.random.default_rng((seed, i))
        name = PHOTOS[i % len(PHOTOS)]
        source = sources[name]
        h, w = int(rng.integers(340, 421)), int(rng.integers(400, 501))
        h, w = min(h, source.shape[0]), min(w, source.shape[1])
        y, x = (
            int(rng.integers(0, source.shape[0] - h + 1)),
            int(rng.integers(0, source.shape[1] - w + 1)),
        )
        crop = np.ascontiguousarray(source[y : y + h, x : x + w])
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        folder = Path(root) / split / name
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i:05d}.JPEG"
        cv2.imwrite(
            str(path),
            cv2.cvtColor(crop, cv2.COLOR_RGB2BGR),
            [cv2.IMWRITE_JPEG_QUALITY, int(rng.integers(90, 96))],
        )
        sizes.append((w, h, path.stat().st_size))
    return sizes


def build_photos(
    root: Path, count: int, seed: int = 0, split: str = "train", processes: int = 1
) -> dict:
    """`count` JPEGs cut from scikit-image's photographs into <root>/<split>/<photo>/: ~440 x 390
    px, quality 90-95."""
    bounds = np.linspace(0, count, max(1, processes) + 1).astype(int)
    parts = [
        (str(root), split, seed, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a
    ]
    if processes > 1:
        from multiprocessing import get_context

        with get_context("spawn").Pool(processes) as pool:
            sizes = [s for part in pool.map(_write, parts) for s in part]
    else:
        sizes = [s for part in parts for s in _write(part)]
    w, h, b = (float(np.mean(v)) for v in zip(*sizes))
    return {
        "images": count,
        "mean_width": round(w),
        "mean_height": round(h),
        "mean_kb": round(b / 1024, 1),
    }


def ensure_photo_set(root: Path, train: int, val: int, processes: int = 1) -> Path:
    """An ImageFolder tree of real photos at `root` (train and val splits), written unless a
    finished one is there."""
    root = Path(root)
    if not (root / "done").is_file():
        build_photos(root, train, split="train", processes=processes)
        build_photos(root, val, seed=1, split="val", processes=processes)
        (root / "done").write_text(f"{train} train, {val} val\n")
    return root


if __name__ == "__main__":
    import argparse
    import os

    parser = argparse.ArgumentParser(
        description="write an ImageFolder tree of real photos (train and val splits)"
    )
    parser.add_argument("root", type=Path)
    parser.add_argument("--train", type=int, default=10240)
    parser.add_argument("--val", type=int, default=256)
    args = parser.parse_args()
    root = ensure_photo_set(args.root, args.train, args.val, processes=min(16, os.cpu_count() or 1))
    print(
        f"{root}: {(root / 'done').read_text().strip()} photos in 5 classes; train on them with\n"
        f"  python tools/train.py data=imagenet data.root={root} ..."
    )
