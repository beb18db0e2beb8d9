"""Prediction speed on real photographs: `tools/predict.py`'s path against a plain PyTorch inference
loop over the same model, the same batches and the same decoded images, with the loader's rate
beside them.

The photographs are scikit-image's, cut at ImageNet's sizes and re-encoded as JPEG
(`benchmarks/photos.py`), in one folder. Three loops, timed in alternating rounds (each round in the
reverse order of the last: a slow spell of the machine hits every loop), median images/s of the
rounds:

- `predict`: what a rank of tools/predict.py runs, whole: the source read by its loader (the data
  config's workers, decoding and the run's eval resize / crop in them), the model under the run's
  precision, softmax and top-k, each batch's records written to a part file as the tool writes them;
- `plain loop`: what a user writes by hand: a `DataLoader` with as many workers over the same files,
  each read by the same reader and cropped by the same transform, batches stacked; then normalise,
  the model, softmax and top-k to the host. `predict / plain loop` >= 0.95 says the tool's
  bookkeeping (records, part files, its loader's error handling) costs nothing that matters;
- `model alone`: the same batches decoded and cropped beforehand, only the model's part of the plain
  loop timed: the ceiling, where the images cost nothing. On a CPU the loader workers decode on the
  cores the model's threads use, so a small model loses to them what a GPU's host would not;
- `loader`: the tool's loader alone (what it can feed).

The threads and loader workers are the tool's on this machine (one rank: every usable CPU for the
model, `data.num_workers=-1`).

    python benchmarks/predict.py  # ViT-S/16 at 224 px, 192 photos, batch 32
    python benchmarks/predict.py --model vit_tiny --images 256 --rounds 5 --markdown out.md
    python benchmarks/predict.py --device cuda --precision bf16 --compile --images 2048 --batch 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from omegaconf import OmegaConf
from photos import build_photos

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_small")
    parser.add_argument("--images", type=int, default=192)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="32")
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the model (both loops share it)"
    )
    parser.add_argument(
        "--workers", type=int, default=-1, help="data.num_workers (-1: the tool's automatic count)"
    )
    parser.add_argument("--markdown", type=Path, help="append the table to this file")
    args = parser.parse_args(argv)

    from visiondist.config.compose import compose
    from visiondist.data.decode import read_rgb
    from visiondist.data.workers import close_loaders, loader_workers
    from visiondist.inference.model import Predictor, load_model
    from visiondist.inference.names import Names
    from visiondist.inference.outputs import PartWriter, batches
    from visiondist.inference.run import loader, run_batches
    from visiondist.inference.sources import resolve_source
    from visiondist.utils.procenv import threads_per_rank

    torch.set_num_threads(threads_per_rank(1))  # one rank's threads, as the launcher sets them
    device = torch.device(args.device)
    work = Path(tempfile.mkdtemp(prefix="predict_bench_"))
    photos = build_photos(work / "photos", args.images, split="val")
    cfg = compose(
        CONFIGS,
        [
            f"model={args.model}",
            "data=imagenet",
            f"data.root={work / 'photos'}",
            "data.num_classes=5",
            f"data.img_size={args.size}",
            f"data.num_workers={args.workers}",
            f"trainer.precision={args.precision}",
        ],
    )
    cfg = OmegaConf.merge(cfg, {"predict": {"batch_size": args.batch, "topk": 5}})
    model = load_model(cfg, device)  # random weights: the speed does not depend on them
    # (a ViT on a GPU comes compiled, as the tool runs it)
    if args.compile and not hasattr(model, "_orig_mod"):
        model = torch.compile(model)
    predictor = Predictor(
        cfg, model, device, Names([f"photo {k}" for k in range(5)], None, "benchmark")
    )
    source = resolve_source(str(work / "photos" / "val"))
    order = batches(len(source), args.batch)
    # the plain loop's images
    decoded = [predictor.prepare(read_rgb(p), i) for i, p in enumerate(source.paths)]

    def predict_loop() -> int:
        writer = PartWriter(work / "out", 0)
        count = 0
        for records in run_batches(
            predictor, source, loader(source, predictor, order, 0, args.workers), None
        ):
            writer.write(records)
            count += len(records)
        writer.close()
        return count

    @torch.inference_mode()
    def classify(batch: torch.Tensor) -> None:
        x = predictor.normalize(batch, device)
        with predictor.autocast:
            probs = model(x).float().softmax(dim=1)
        top = probs.topk(5, dim=1)
        top.values.cpu(), top.indices.cpu()

    class Files(torch.utils.data.Dataset):  # a user's own dataset: the same reader and transform
        def __len__(self):
            return len(source.paths)

        def __getitem__(self, i):
            return predictor.prepare(read_rgb(source.paths[i]), i)

    workers = loader_workers(int(cfg.data.num_workers), 1)

    def plain_loop() -> int:
        plain = torch.utils.data.DataLoader(
            Files(),
            batch_size=args.batch,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=False,
        )
        count = 0
        for batch in plain:
            classify(batch)
            count += len(batch)
        return count

    def model_alone() -> int:
        for b in order:
            classify(torch.stack([decoded[i] for i in b]))
        return len(decoded)

    def loader_loop() -> int:
        return sum(len(items) for items in loader(source, predictor, order, 0, args.workers))

    loops = {
        "predict (tools/predict.py's path)": predict_loop,
        "plain PyTorch loop (its own DataLoader)": plain_loop,
        "model alone (images decoded beforehand)": model_alone,
        "loader alone": loader_loop,
    }
    for fn in loops.values():  # warm-up: allocation, compilation, the workers' first start
        fn()
        close_loaders()
    rates: dict[str, list[float]] = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            count = loops[name]()
            if device.type == "cuda":
                torch.cuda.synchronize()
            rates[name].append(count / (time.perf_counter() - start))
            close_loaders()
    median = {name: statistics.median(v) for name, v in rates.items()}
    ratio, ceiling = median[names[0]] / median[names[1]], median[names[0]] / median[names[2]]
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    lines = [
        f"{args.model} at {args.size} px, batch {args.batch}, precision "
        f"{args.precision}{', compiled' if args.compile else ''}, {args.images} photos "
        f"(~{photos['mean_width']}x{photos['mean_height']} px JPEG), {where}, {workers} loader "
        f"worker{'' if workers == 1 else 's'}, torch {torch.__version__}, median of {args.rounds} "
        "rounds",
        "",
        "| loop | images/s | rounds |",
        "| --- | ---: | --- |",
    ]
    lines += [
        f"| {name} | {median[name]:.1f} | {', '.join(f'{v:.1f}' for v in rates[name])} |"
        for name in names
    ]
    lines += ["", f"predict / plain loop: {ratio:.3f}; predict / model alone: {ceiling:.3f}"]
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
