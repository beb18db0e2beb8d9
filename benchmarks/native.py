"""Native resolution (`data.resolution=native`) against square crops, measured side by side in one
run.

Three parts (`--part`, default all):

- `padding`: on real photographs of mixed aspect ratios (`benchmarks/photos.py`'s, every other one
  turned upright, so that landscape and portrait mix), the share of an epoch's tokens that are
  padding, one image to a sequence against packed (`data.native.pack`), at ViT-S/16's 224 px budget
  (sequences of 98, 196 and 392 patches);
- `rate`: the same photographs through a narrow ViT/16 on this machine (forward, backward and
  AdamW), square 224 px batches against native steps of the same token budget at each length, one
  image to a sequence and packed; images and patch tokens a second, median of alternating rounds
  (each round in the reverse order of the last). The loader's own rate beside it: the square
  eval-free train transform against the native one, on the same files;
- `top1`: the built-in shapes set with images from 3:1 to 1:3 (`data.synthetic.max_aspect=3`), a
  ViT-Ti of 4 blocks at patch 8, trained for the same number of steps (each step the same token
  budget: the same compute) square and native, three seeds each; val top-1, mean and spread. Each
  run is `tools/train.py`, as a user runs it.

    python benchmarks/native.py  # all three, on the CPU
    python benchmarks/native.py --part top1 --steps 200 --seeds 0 1 2
    # a GPU's row
    python benchmarks/native.py --part rate --model vit_base --device cuda --precision bf16 \
        --batch 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cv2  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

PATCH, SIZE = 16, 224
LENS = [98, 196, 392]


def photo_set(root: Path, count: int) -> Path:
    """`count` photographs at ImageNet's sizes, every other one turned upright (portrait)."""
    from photos import build_photos

    if not (root / "done").is_file():
        build_photos(root, count)
        for k, path in enumerate(sorted((root / "train").rglob("*.JPEG"))):
            if k % 2:
                image = cv2.imread(str(path))
                cv2.imwrite(str(path), cv2.transpose(image), [cv2.IMWRITE_JPEG_QUALITY, 93])
        (root / "done").write_text("ok\n")
    return root / "train"


def data_cfg(**extra):
    return OmegaConf.create(
        {
            "train_crop_scale": [0.08, 1.0],
            "hflip": 0.5,
            "interpolation": "bilinear",
            "auto_augment": "none",
            "random_erasing": 0.0,
            "crop_pct": 0.875,
            "augment_on": "device",
            "decode_on": "loader",
            **extra,
        }
    )


def padding(folder: Path, batch: int) -> list[dict]:
    """Padding share of one epoch's steps, one image to a sequence (each filling its step's length)
    and packed (each image's size drawn, then first fit)."""
    from visiondist.data.imagefolder import ImageFolder
    from visiondist.data.native import NativeBatchSampler, NativeCollate, NativeTransform

    rows = []
    for packs in (False, True):
        images = ImageFolder(folder, NativeTransform(data_cfg(), True, PATCH, 0, 196, pack=packs))
        sampler = NativeBatchSampler(
            len(images), batch, (SIZE // PATCH) ** 2, LENS, 0, 1, packed=packs
        )
        sampler.set_epoch(0)
        collate = NativeCollate(PATCH, LENS, packs)
        valid = total = sequences = count = 0
        for keys in sampler:
            patches, _ = collate([images[k] for k in keys])
            valid += int((patches.segments > 0).sum())
            total += patches.segments.numel() + patches.slots.numel()  # class slots count as tokens
            sequences += patches.segments.shape[0]
            count += len(keys)
        rows.append(
            {
                "mode": "packed" if packs else "one image a sequence",
                "images": count,
                "sequences": sequences,
                "padding (%)": round(100 * (1 - (valid + count) / total), 1),
            }
        )
    return rows


# --model: the ViT/16 the rate part times (embed_dim, depth, num_heads); "narrow" is the CPU's
MODELS = {"narrow": (192, 4, 3), "vit_small": (384, 12, 6), "vit_base": (768, 12, 12)}


def rate(
    folder: Path,
    batch: int,
    rounds: int,
    model_name: str = "narrow",
    device: str = "cpu",
    precision: str = "32",
) -> list[dict]:
    """Images and patch tokens a second of a ViT/16's training step (`MODELS`), square against
    native, and the loaders' transforms alone. On a GPU every step is timed to its end
    (synchronised), under bf16 autocast with `precision=bf16`; the attention kernel is each case's
    own (SDPA picks flash for square batches, a masked kernel for native ones)."""
    from visiondist.data.imagefolder import ImageFolder
    from visiondist.data.native import NativeCollate, NativeTransform
    from visiondist.data.transforms import ClassificationTransform, Normalize
    from visiondist.models.vit import VisionTransformer

    torch.manual_seed(0)
    dev = torch.device(device)
    width, depth, heads = MODELS[model_name]
    model = VisionTransformer(
        img_size=SIZE,
        patch_size=PATCH,
        num_classes=10,
        embed_dim=width,
        depth=depth,
        num_heads=heads,
    ).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    normalize = Normalize([0.5] * 3, [0.25] * 3)
    square_tf = ClassificationTransform(data_cfg(), True, SIZE, 0)
    native_tf = NativeTransform(data_cfg(), True, PATCH, 0, 196)
    # sizes drawn: 4x the images
    packing_tf = NativeTransform(data_cfg(), True, PATCH, 0, 196, pack=True)
    files = ImageFolder(folder, None)
    raw = [files[i][0] for i in range(len(files))]
    budget = batch * (SIZE // PATCH) ** 2
    cases = {"square 224 px": (batch, None, False)}
    for n in LENS:
        cases[f"native {n}"] = (max(1, budget // n), n, False)
        cases[f"native {n} packed"] = (4 * max(1, budget // n), n, True)
    prepared = {}
    for name, (count, n, packs) in cases.items():
        if n is None:
            images = torch.stack([square_tf._crop(raw[i % len(raw)]) for i in range(count)])
            prepared[name] = (normalize(images, dev), count * (SIZE // PATCH) ** 2)
        else:
            crops = [
                (packing_tf if packs else native_tf)(raw[i % len(raw)], i, 0, n)[0]
                for i in range(count)
            ]
            patches, _ = NativeCollate(PATCH, [n], packs)([(c, 0) for c in crops])
            prepared[name] = (normalize(patches, dev), int((patches.segments > 0).sum()))
    labels = {name: torch.zeros(cases[name][0], dtype=torch.long, device=dev) for name in cases}

    def step(name):
        x, _ = prepared[name]
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(x), labels[name])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def transform(name):
        count, n, _ = cases[name]
        for i in range(min(count, 64)):
            if n is None:
                square_tf._crop(raw[i % len(raw)])
            else:
                native_tf(raw[i % len(raw)], i, 0, n)
        return min(count, 64)

    for name in cases:  # warm-up
        step(name)
    times = {name: [] for name in cases}
    loader = {name: [] for name in ("square 224 px", "native 196")}
    order = list(cases)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
        for name in list(loader) if r % 2 == 0 else list(loader)[::-1]:
            start = time.perf_counter()
            n = transform(name)
            loader[name].append(n / (time.perf_counter() - start))
    rows = []
    square = statistics.median(times["square 224 px"])
    for name, (count, _, _) in cases.items():
        t = statistics.median(times[name])
        rows.append(
            {
                "case": name,
                "model": model_name,
                "device": _device_name(dev),
                "precision": precision,
                "images a step": count,
                "patch tokens a step": prepared[name][1],
                "images/s": round(count / t, 1),
                "tokens/s": round(prepared[name][1] / t),
                "step / square step": round(t / square, 3),
            }
        )
    rows.append(
        {
            "loader transform (images/s, one core)": {
                k: round(statistics.median(v), 1) for k, v in loader.items()
            }
        }
    )
    return rows


def _device_name(dev: torch.device) -> str:
    return (
        torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)"
    )


def top1(work: Path, steps: int, seeds: list[int]) -> list[dict]:
    common = [
        "data.synthetic.max_aspect=3",
        f"data.root={work / 'shapes_aspect3'}",
        "model.depth=4",
        "model.patch_size=8",
        f"trainer.max_steps={steps}",
        f"trainer.eval_every={steps}",
        "trainer.progress=false",
        "trainer.plots=false",
        "trainer.loggers=[csv]",
        "trainer.accelerator=cpu",
        "trainer.devices=1",
    ]
    rows = []
    for mode in ("square", "native"):
        for seed in seeds:
            run = work / f"{mode}_{seed}"
            args = [
                *common,
                f"trainer.seed={seed}",
                f"trainer.run_dir={run}",
                f"data.resolution={mode}",
            ]
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, str(REPO / "tools" / "train.py"), *args],
                capture_output=True,
                text=True,
                cwd=REPO,
            )
            if done.returncode:
                raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
            summary = json.loads((run / "summary.json").read_text())
            rows.append(
                {
                    "mode": mode,
                    "seed": seed,
                    "steps": summary["steps"],
                    "epochs": summary["epochs"],
                    "val top-1 (%)": summary["val top-1 (%)"],
                    "seconds": round(time.perf_counter() - start),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    for mode in ("square", "native"):
        values = [r["val top-1 (%)"] for r in rows if r["mode"] == mode]
        rows.append(
            {
                "mode": mode,
                "mean top-1 (%)": round(statistics.mean(values), 2),
                "spread (max - min)": round(max(values) - min(values), 2),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("padding", "rate", "top1", "all"), default="all")
    parser.add_argument("--photos", type=int, default=256)
    parser.add_argument(
        "--batch", type=int, default=32, help="square images a step (the token budget's measure)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150, help="top1: training steps of every run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="narrow", help="rate: the ViT/16 timed"
    )
    parser.add_argument("--device", default="cpu", help="rate: cpu or cuda")
    parser.add_argument(
        "--precision", choices=("32", "bf16"), default="32", help="rate: bf16 autocast or fp32"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="native-bench-"))
    print(
        json.dumps(
            {"torch": torch.__version__, "threads": torch.get_num_threads(), "work": str(work)}
        )
    )
    if args.part in ("padding", "rate", "all"):
        folder = photo_set(work / "photos", args.photos)
    if args.part in ("padding", "all"):
        for row in padding(folder, 64):
            print(json.dumps({"part": "padding", **row}), flush=True)
    if args.part in ("rate", "all"):
        for row in rate(folder, args.batch, args.rounds, args.model, args.device, args.precision):
            print(json.dumps({"part": "rate", **row}), flush=True)
    if args.part in ("top1", "all"):
        for row in top1(work, args.steps, args.seeds):
            print(json.dumps({"part": "top1", **row}), flush=True)


if __name__ == "__main__":
    main()
