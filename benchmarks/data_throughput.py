"""Training input path per CPU core, on real photographs: what one loader worker delivers, and how
many cores an H100 needs to stay fed.

The data: the photographs scikit-image ships (astronaut, coffee, chelsea, rocket, stereo_motorcycle;
no download), cropped at ImageNet's sizes (about 440 x 390 px, 400-500 by 340-420) and re-encoded as
JPEG at quality 90-95, in an ImageFolder tree. Each pipeline runs through a real `DataLoader` with
one worker pinned to one core (`--core`; the main process stays on another), 224 px crops, batches
of 64, in alternating rounds (a slow spell of the machine hits every pipeline), and reports the
median images/s of its rounds:

- `before`: the path as it was: a seed per albumentations transform (SeedSequence +
  `set_random_seed`), C, H, W tensors handed over, RandAugment in the worker on the uint8 tensor
  under `torch.manual_seed` in `fork_rng`;
- `PIL + torchvision v2`: what a plain PyTorch user writes (Pillow decode, v2 RandomResizedCrop +
  flip [+ RandAugment on the PIL image], `ToImage`);
- one change at a time on top of `before`: one random stream per sample (`stream`), H, W, C
  hand-over (`hwc`), auto-augment on the device (`device_aug`: the worker only draws the
  parameters);
- `visiondist`: the shipped `ClassificationTransform` (all of them);
- `visiondist, decode_on=device`: the worker reads the bytes, parses the header and draws the crop;
  decoding, crop and resize move to the device (what the worker costs; the device's side is in the
  GPU figures).

Then, in one process on one thread, where one image's time goes (decode, crop + flip, seeding,
RandAugment, collate), and the cores one H100 needs at 50% of its 989 dense bf16 TFLOP/s for
ViT-S/B/L-16 (training FLOPs per image counted by `FlopCounterMode` on this project's models). With
a CUDA device, also: nvJPEG decode images/s, and the device augmentation's share of a ViT-B/16 step
(batch 256, bf16).

    python benchmarks/data_throughput.py  # 640 photos, 5 rounds, worker on core 1
    python benchmarks/data_throughput.py --images 640 --rounds 7 --markdown out.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from input_recipe import BATCH, SIZE, recipe_cfg
from photos import build_photos
from torch.utils.data import DataLoader, Dataset

from visiondist.data.decode import read_rgb
from visiondist.data.device_decode import collate_encoded, read_encoded
from visiondist.data.imagefolder import ImageFolder
from visiondist.data.transforms import (
    ClassificationTransform,
    SampleRandom,
    classification_transforms,
)

H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak, SXM
MFU = 0.5


class Variant:
    """The path as it was, with each change switchable: `stream` (one random stream per sample
    instead of a seed per transform and `torch.manual_seed` for RandAugment), `hwc` (H, W, C
    hand-over), `device_aug` (the worker draws the auto-augment parameters; the device applies
    them)."""

    def __init__(self, auto_augment: str, stream=False, hwc=False, device_aug=False, seed=0):
        from torchvision.transforms import v2

        from visiondist.data.augment import AugmentPolicy

        self.transform = classification_transforms(recipe_cfg(auto_augment), True, SIZE)
        self.stream, self.hwc, self.device_aug, self.seed = stream, hwc, device_aug, seed
        self.auto = v2.RandAugment() if auto_augment == "rand" else None
        self.policy = AugmentPolicy(auto_augment, SIZE)
        self.random = SampleRandom()
        if stream:
            self.transform.set_random_state(self.random.numpy, self.random.python)

    def __call__(self, image, index, epoch):
        if self.stream:
            self.random.reset(self.seed, epoch, index)
        else:
            seed = int(np.random.SeedSequence([self.seed, epoch, index]).generate_state(1)[0])
            self.transform.set_random_seed(seed)
        image = torch.from_numpy(np.ascontiguousarray(self.transform(image=image)["image"]))
        chw = image.permute(2, 0, 1)
        if self.auto is None:
            return image if self.hwc else chw
        if self.device_aug:
            row = torch.from_numpy(
                self.policy.draw(self.random.python if self.stream else _python_random(seed))
            )
            return (image if self.hwc else chw), row
        if self.stream:
            out = self.policy.apply_loader(chw, self.policy.draw(self.random.python))
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                out = self.auto(chw)
        return out.permute(1, 2, 0).contiguous() if self.hwc else out


def _python_random(seed: int):
    import random

    return random.Random(seed)


class PillowFolder(Dataset):
    """Pillow decode + torchvision transforms v2, as a plain PyTorch user writes it."""

    def __init__(self, samples, auto_augment: str):
        from torchvision.transforms import v2

        steps = [
            v2.RandomResizedCrop(SIZE, scale=(0.08, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
        ]
        if auto_augment == "rand":
            steps.append(v2.RandAugment())
        self.samples, self.transform = samples, v2.Compose([*steps, v2.PILToTensor()])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, key):
        from PIL import Image

        index = key[0] if isinstance(key, tuple) else key
        path, label = self.samples[index]
        with Image.open(path) as image:
            return self.transform(image.convert("RGB")), label


def _pin(core: int):
    def init(_worker_id):
        os.sched_setaffinity(0, {core})
        cv2.setNumThreads(1)
        torch.set_num_threads(1)

    return init


def loaders(root: Path, recipe: str, core: int) -> dict[str, DataLoader]:
    split = root / "train"
    samples = ImageFolder(split).samples
    sets = {
        "before": ImageFolder(split, Variant(recipe)),
        "PIL + torchvision v2": PillowFolder(samples, recipe),
        "+ stream": ImageFolder(split, Variant(recipe, stream=True)),
        "+ hwc": ImageFolder(split, Variant(recipe, hwc=True)),
    }
    if recipe != "none":
        sets["+ device_aug"] = ImageFolder(split, Variant(recipe, device_aug=True))
    sets["visiondist"] = ImageFolder(
        split, ClassificationTransform(recipe_cfg(recipe), True, SIZE, seed=0)
    )
    sets["visiondist, decode_on=device"] = ImageFolder(
        split,
        ClassificationTransform(recipe_cfg(recipe, decode_on="device"), True, SIZE, seed=0),
        reader=read_encoded,
    )
    keys = [(i, 0) for i in range(len(samples))]
    order = [keys[i : i + BATCH] for i in range(0, len(keys) - BATCH + 1, BATCH)]
    collate = {"visiondist, decode_on=device": collate_encoded(SIZE, "bilinear")}
    return {
        name: DataLoader(
            ds,
            batch_sampler=order,
            num_workers=1,
            worker_init_fn=_pin(core),
            prefetch_factor=2,
            persistent_workers=True,
            collate_fn=collate.get(name),
        )
        for name, ds in sets.items()
    }


def rate(loader: DataLoader) -> float:
    """Images per second over one whole pass, the first batch included: the worker is already
    running (persistent, warmed up by a full pass), and timing from the first batch on would credit
    the batches it prefetched while the first was awaited (a fast pipeline's whole pass, at a few
    batches)."""
    start, images = time.perf_counter(), 0
    for batch in loader:
        images += len(batch[0])
    return images / (time.perf_counter() - start)


def per_image_split(root: Path, count: int = 128) -> dict[str, float]:
    """Microseconds per image of each step, in this process on one thread, over the first `count`
    photos."""
    from torchvision.transforms import v2

    from visiondist.data.augment import AugmentPolicy

    paths = [p for p, _ in ImageFolder(root / "train").samples][:count]
    crop = classification_transforms(recipe_cfg("rand"), True, SIZE)
    stream, policy, auto = SampleRandom(), AugmentPolicy("rand", SIZE), v2.RandAugment()
    crop.set_random_state(stream.numpy, stream.python)
    out: dict[str, list[float]] = {
        k: []
        for k in (
            "read + decode",
            "seed: a seed per transform + fork_rng",
            "seed: one stream",
            "crop + flip",
            "RandAugment (worker)",
            "draw parameters",
            "hand-over: stack C, H, W views",
            "hand-over: stack H, W, C",
        )
    }

    def timed(key, fn):
        t = time.perf_counter()
        result = fn()
        out[key].append((time.perf_counter() - t) * 1e6)
        return result

    crops = []
    for i, path in enumerate(paths):
        image = timed("read + decode", lambda path=path: read_rgb(str(path)))

        def old_seed(i=i):
            crop.set_random_seed(i)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(i)

        timed("seed: a seed per transform + fork_rng", old_seed)
        crop.set_random_state(stream.numpy, stream.python)
        timed("seed: one stream", lambda i=i: stream.reset(0, 0, i))
        hwc = timed(
            "crop + flip",
            lambda image=image: torch.from_numpy(np.ascontiguousarray(crop(image=image)["image"])),
        )
        timed("RandAugment (worker)", lambda hwc=hwc: auto(hwc.permute(2, 0, 1)))
        timed("draw parameters", lambda: policy.draw(stream.python))
        crops.append(hwc)
    for _ in range(3):
        batch = crops[:BATCH]
        for key, views in (
            ("hand-over: stack C, H, W views", [c.permute(2, 0, 1) for c in batch]),
            ("hand-over: stack H, W, C", batch),
        ):
            t = time.perf_counter()
            torch.stack(views, out=torch.empty((len(views), *views[0].shape), dtype=torch.uint8))
            out[key].append((time.perf_counter() - t) * 1e6 / len(views))
    return {k: round(statistics.median(v), 1) for k, v in out.items()}


def vit_train_flops() -> dict[str, float]:
    """Training FLOPs per 224-px image (forward + backward) of ViT-S/B/L-16, counted on the meta
    device."""
    from visiondist.bench.measure import train_flops_per_image
    from visiondist.cli import load_config

    out = {}
    for name in ("vit_small", "vit_base", "vit_large"):
        cfg = load_config(
            Path(__file__).resolve().parents[1] / "configs",
            [f"model={name}", f"data.img_size={SIZE}", "data.num_classes=1000"],
            inputs=None,
        ).model
        batch = (torch.zeros(1, SIZE, SIZE, 3, dtype=torch.uint8), torch.zeros(1, dtype=torch.long))
        out[name] = train_flops_per_image(cfg, batch, "classification")
    return out


def recipe_rounds(root: Path, recipe: str, title: str, core: int, rounds: int) -> dict:
    """One recipe's pipelines in alternating rounds: median images/s and median ratio to PIL +
    torchvision v2."""
    runs = loaders(root, recipe, core)
    for loader in runs.values():  # start every worker, warm caches and lazy imports: one whole pass
        rate(loader)
    seen: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, loader in runs.items():
            seen[name].append(rate(loader))
    medians = {name: statistics.median(r) for name, r in seen.items()}
    base = seen["PIL + torchvision v2"]
    ratios = {name: statistics.median(a / b for a, b in zip(r, base)) for name, r in seen.items()}
    print(
        f"\n{title}: images/s per core (median of {rounds} rounds), ratio to PIL + torchvision v2"
    )
    for name in runs:
        print(f"  {name:<24} {medians[name]:8.0f}   {ratios[name]:.2f}x")
    return {"title": title, "images_per_s": medians, "vs_pil": ratios}


def cores_per_h100(recipes: dict) -> dict:
    """Cores one H100 needs at 50% MFU for ViT-S/B/L-16, per recipe and pipeline."""
    out = {}
    print(
        f"\ncores per H100 at {MFU:.0%} of {H100_BF16_FLOPS / 1e12:.0f} TFLOP/s (images/s the GPU "
        "takes):"
    )
    for model, f in vit_train_flops().items():
        need = MFU * H100_BF16_FLOPS / f
        row = {"train_gflops_per_image": round(f / 1e9, 1), "images_per_s": round(need)}
        for recipe in ("none", "rand"):
            for name in (
                "PIL + torchvision v2",
                "before",
                "visiondist",
                "visiondist, decode_on=device",
            ):
                row[f"{recipe}: {name}"] = round(need / recipes[recipe]["images_per_s"][name], 2)
        out[model] = row
        print(
            f"  {model:<10} {row['images_per_s']:6d} images/s: "
            + ", ".join(f"{k} {v}" for k, v in row.items() if ":" in k)
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--images", type=int, default=640, help="at least 10 batches of 64 give stable rates"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--core", type=int, default=1, help="the core the loader worker is pinned to"
    )
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    parser.add_argument(
        "--gpu-only", action="store_true", help="only the CUDA device's figures (no CPU rounds)"
    )
    args = parser.parse_args()
    if args.images < 10 * BATCH:
        print(
            f"note: {args.images} images are {args.images // BATCH} batches a round; below 10 the "
            "rates of the fast pipelines are not stable",
            flush=True,
        )
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    main_cores = (os.sched_getaffinity(0) - {args.core}) or os.sched_getaffinity(0)
    os.sched_setaffinity(0, main_cores)
    result: dict = {"core": args.core, "rounds": args.rounds}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        result["data"] = build_photos(root, args.images)
        print(
            f"{args.images} photos, mean {result['data']['mean_width']} x "
            f"{result['data']['mean_height']} px, {result['data']['mean_kb']} KB; one worker on "
            f"core {args.core}, {SIZE} px, batch {BATCH}",
            flush=True,
        )
        if args.gpu_only:
            return gpu_only(root, result, args)
        result["recipes"] = {
            recipe: recipe_rounds(root, recipe, title, args.core, args.rounds)
            for recipe, title in (
                ("none", "default (crop + flip)"),
                ("rand", "DeiT (+ RandAugment 2/9; erasing and mixup run on the device)"),
            )
        }
        result["per_image_us"] = per_image_split(root)
        print("\nper image, one thread (us):")
        for k, v in result["per_image_us"].items():
            print(f"  {k:<40} {v:8.1f}")
        result["cores_per_h100"] = cores_per_h100(result["recipes"])
        if torch.cuda.is_available():
            from data_throughput_gpu import gpu_figures

            result["gpu"] = gpu_figures(root)
            print("\nGPU:", result["gpu"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.markdown:
        args.markdown.write_text(markdown(result))


def gpu_only(root: Path, result: dict, args) -> None:
    from data_throughput_gpu import gpu_figures

    result["gpu"] = gpu_figures(root)
    print("\nGPU:", result["gpu"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def markdown(r: dict) -> str:
    d = r["data"]
    lines = [
        f"{d['images']} photos (scikit-image's, cut at ~{d['mean_width']} x {d['mean_height']} "
        f"px, {d['mean_kb']} KB, JPEG q90-95), one loader worker pinned to one core, {SIZE} px, "
        f"batch {BATCH}, median of {r['rounds']} alternating rounds.",
        "",
    ]
    names = list(r["recipes"]["rand"]["images_per_s"])
    lines += [
        "| images/s per core | "
        + " | ".join(r["recipes"][k]["title"] for k in ("none", "rand"))
        + " |",
        "|---|---|---|",
    ]
    for name in names:
        cells = []
        for k in ("none", "rand"):
            rec = r["recipes"][k]
            cells.append(
                f"{rec['images_per_s'][name]:.0f} ({rec['vs_pil'][name]:.2f}x)"
                if name in rec["images_per_s"]
                else "-"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| per image, one thread | us |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in r["per_image_us"].items()]
    kinds = ("PIL + torchvision v2", "before", "visiondist", "visiondist, decode_on=device")
    lines += [
        "",
        "| cores per H100 at 50% MFU | images/s | "
        + " | ".join(f"{recipe}: {kind}" for recipe in ("default", "DeiT") for kind in kinds)
        + " |",
        "|---" * 10 + "|",
    ]
    for model, row in r["cores_per_h100"].items():
        cells = [row[f"{k}: {n}"] for k in ("none", "rand") for n in kinds]
        lines.append(
            f"| {model} ({row['train_gflops_per_image']} GFLOP) | {row['images_per_s']} | "
            + " | ".join(str(c) for c in cells)
            + " |"
        )
    if "gpu" in r:
        lines += [
            "",
            f"GPU ({r['gpu']['device']}): "
            + ", ".join(f"{k} {v}" for k, v in r["gpu"].items() if k != "device"),
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
