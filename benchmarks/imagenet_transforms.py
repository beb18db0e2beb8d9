"""Train-transform throughput per core: visiondist's ImageNet pipeline (OpenCV decode + albumentations) vs PIL +
torchvision transforms v2, on the same generated 500x375 JPEGs, in one run.

Both do what a training loader's worker does per sample: read the file, decode to RGB, random-resized-crop to 224
(scale 0.08-1), flip, make a uint8 CHW tensor (normalisation happens on the device, after the copy). One thread each
(OpenCV and torch), so the figure is per core.

    python benchmarks/imagenet_transforms.py                 # 300 images, 7 alternating passes each
    python benchmarks/imagenet_transforms.py --auto-augment trivial
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from visiondist.data.imagefolder import read_rgb  # noqa: E402
from visiondist.data.transforms import ClassificationTransform  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def generate(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """Photo-like 500x375 JPEGs (quality 90): smooth colour fields, edges and noise."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        low = rng.uniform(0, 255, (6, 8, 3)).astype(np.float32)
        image = cv2.resize(low, (500, 375), interpolation=cv2.INTER_CUBIC)
        for _ in range(6):
            centre = tuple(int(v) for v in rng.integers(0, (500, 375)))
            cv2.circle(image, centre, int(rng.integers(10, 120)), tuple(float(v) for v in rng.uniform(0, 255, 3)), -1)
        image = np.clip(image + rng.normal(0, 12, image.shape), 0, 255).astype(np.uint8)
        path = folder / f"{i:05d}.JPEG"
        cv2.imwrite(str(path), image, [cv2.IMWRITE_JPEG_QUALITY, 90])
        paths.append(path)
    return paths


def ours(auto_augment: str):
    cfg = OmegaConf.create(dict(mean=MEAN, std=STD, train_crop_scale=[0.08, 1.0], hflip=0.5, crop_pct=0.875,
                                auto_augment=auto_augment))
    transform = ClassificationTransform(cfg, train=True, size=224, seed=0)
    return lambda path, i: transform(read_rgb(str(path)), i, 0)


def pil_torchvision(auto_augment: str):
    from PIL import Image
    from torchvision.transforms import v2

    steps = [v2.RandomResizedCrop(224, scale=(0.08, 1.0), antialias=True), v2.RandomHorizontalFlip()]
    if auto_augment == "rand":
        steps.append(v2.RandAugment())
    elif auto_augment == "trivial":
        steps.append(v2.TrivialAugmentWide())
    steps += [v2.ToImage()]
    transform = v2.Compose(steps)

    def load(path, i):
        with Image.open(path) as img:
            return transform(img.convert("RGB"))

    return load


def throughput(fn, paths: list[Path], passes: int) -> list[float]:
    rates = []
    for _ in range(passes):
        start = time.perf_counter()
        for i, path in enumerate(paths):
            out = fn(path, i)
        assert out.shape == (3, 224, 224) and out.dtype == torch.uint8
        rates.append(len(paths) / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--auto-augment", choices=("none", "rand", "trivial"), default="none")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = generate(Path(tmp), args.images)
        candidates = {"visiondist (OpenCV + albumentations)": ours(args.auto_augment),
                      "PIL + torchvision v2": pil_torchvision(args.auto_augment)}
        for fn in candidates.values():  # warm-up: caches, lazy imports
            throughput(fn, paths[:20], 1)
        passes = {name: [] for name in candidates}
        for _ in range(args.passes):  # alternate, so that a slow spell of the machine hits both
            for name, fn in candidates.items():
                passes[name] += throughput(fn, paths, 1)
        rates = {name: statistics.median(r) for name, r in passes.items()}
        ratio = statistics.median(a / b for a, b in zip(*passes.values()))
    print(f"\ntrain transform, {args.images} generated 500x375 JPEGs -> 224 px, auto_augment={args.auto_augment}, "
          f"1 thread, median of {args.passes} passes")
    for name, rate in rates.items():
        print(f"  {name:<38} {rate:8.1f} images/s")
    print(f"  ratio: {ratio:.2f}x (median of the per-pass ratios)")


if __name__ == "__main__":
    main()
