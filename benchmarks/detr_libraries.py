"""Which library to build RF-DETR from: transformers' `RfDetrForObjectDetection` (what
`model=rfdetr_*` uses) against the `rfdetr` package's own network (its `RFDETRNano` / `RFDETRSmall`,
random weights), the same architecture.

Reported per model: parameters, the packages each needs beyond this project's, and on the device at
hand the median time of an eval forward and of a training forward + backward (the outputs' sum as
the loss: the networks' work, not either library's loss), the two libraries alternated in rounds.
The `rfdetr` package is not a dependency of this project: install it where you run this (`pip
install rfdetr`).

    python benchmarks/detr_libraries.py  # RF-DETR-N at 384 px, batch 2, on the CPU
    python benchmarks/detr_libraries.py --model small --batch 8 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _ours(model: str, size: int) -> torch.nn.Module:
    from omegaconf import OmegaConf

    from visiondist.models.detr_library import build_detr

    name = f"rfdetr_{model}"
    cfg = OmegaConf.create(
        {
            "name": name,
            "arch": name,
            "num_classes": 80,
            "img_size": size,
            "kwargs": {},
            "weights": None,
            "multi_scale": None,
        }
    )
    return build_detr(cfg).model


def _theirs(model: str, device: str) -> torch.nn.Module:
    import rfdetr

    wrapper = {"nano": rfdetr.RFDETRNano, "small": rfdetr.RFDETRSmall}[model](
        pretrain_weights=None, num_classes=80, device=device
    )
    return wrapper.model.model


def _outputs_sum(out) -> torch.Tensor:
    if hasattr(out, "logits"):  # transformers' output
        return out.logits.float().sum() + out.pred_boxes.float().sum()
    return out["pred_logits"].float().sum() + out["pred_boxes"].float().sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("nano", "small"), default="nano")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    size = {"nano": 384, "small": 512}[args.model]
    device = torch.device(args.device)
    nets = {
        "transformers": _ours(args.model, size).to(device),
        "rfdetr": _theirs(args.model, args.device).to(device),
    }
    x = torch.rand(args.batch, 3, size, size, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def call(net, train: bool):
        net.train(train)
        if train:
            _outputs_sum(
                net(pixel_values=x) if "transformers" in type(net).__module__ else net(x)
            ).backward()
        else:
            with torch.no_grad():
                net(pixel_values=x) if "transformers" in type(net).__module__ else net(x)

    times = {(name, mode): [] for name in nets for mode in ("eval", "train")}
    for net in nets.values():  # warm-up
        call(net, False), call(net, True)
    for _ in range(args.rounds):
        for name, net in nets.items():
            for mode in ("eval", "train"):
                sync()
                start = time.perf_counter()
                call(net, mode == "train")
                sync()
                times[(name, mode)].append(time.perf_counter() - start)
    print(
        f"RF-DETR-{args.model[0].upper()} at {size} px, batch {args.batch}, {device}, median of "
        f"{args.rounds} alternated rounds"
    )
    print("| library | parameters | eval forward (ms) | train forward + backward (ms) |")
    print("|---|---|---|---|")
    for name, net in nets.items():
        params = sum(p.numel() for p in net.parameters()) / 1e6
        print(
            f"| {name} | {params:.2f}M | {statistics.median(times[(name, 'eval')]) * 1e3:.0f} | "
            f"{statistics.median(times[(name, 'train')]) * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
