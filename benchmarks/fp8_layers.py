"""What float8 gains per linear layer of a ViT (`trainer.fp8`), on the device at hand.

For each distinct linear shape of a model's blocks (attention's d x d projections, the MLP's d x 4d
and 4d x d) at the training step's rows (micro-batch x tokens), one layer's forward + backward is
timed in bf16 (autocast, as training runs it) and as torchao's `Float8Linear` with the tensorwise
and rowwise recipes (`visiondist.engine.fp8`), each compiled as `trainer.compile` compiles the
blocks, all alternated in rounds (`--rounds`), medians reported with the layer's share of a block's
linear time. Public figures say float8 gains little at these widths (torchao: 0.80x bf16 at 1024 x
2048 x 1024; +4% at ~1600 wide); this table says it for the GPU at hand. Needs torchao (`pip install
-e ".[fp8]"`) and, for meaningful figures, a GPU with float8 tensor cores (compute capability 8.9+);
on the CPU it runs the same code with `--tiny` (torch's CPU float8 matmul is a slow reference path).

    python benchmarks/fp8_layers.py  # ViT-B/L/H at 224 px, batch 256 / 128 / 64
    python benchmarks/fp8_layers.py --models vit_huge:64 --markdown fp8.md
    python benchmarks/fp8_layers.py --tiny --device cpu  # the code path, in seconds
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from visiondist.bench.measure import time_steps
from visiondist.engine.fp8 import to_float8

WIDTHS = {"vit_tiny": 192, "vit_small": 384, "vit_base": 768, "vit_large": 1024, "vit_huge": 1280}
PATCH = {"vit_huge": 14}


def layer_shapes(model: str, batch: int, img: int) -> list[tuple[str, int, int, int]]:
    """(name, rows, in, out) of the distinct linear layers of one block, with how many of each a
    block has."""
    d = WIDTHS[model]
    tokens = (img // PATCH.get(model, 16)) ** 2 + 1
    rows = batch * tokens
    return [("q / k / v / proj (x4)", rows, d, d), ("fc1", rows, d, 4 * d), ("fc2", rows, 4 * d, d)]


def time_layer(
    rows: int,
    fan_in: int,
    fan_out: int,
    device: torch.device,
    steps: int,
    rounds: int,
    compile_: bool,
) -> dict[str, float]:
    """Median seconds per forward + backward of one layer: bf16 autocast, float8 tensorwise, float8
    rowwise (each converted whatever torchao's filter says: the table shows both). Dynamo's caches
    are reset first: every layer compiles the same `forward` code, and the rows before would
    otherwise reach the recompile limit (8), after which torch runs the layer eager. A graph break,
    a recompile-limit hit or a compilation while timed raises."""
    from visiondist.bench.harness import CompileWatch

    torch._dynamo.reset()
    base = nn.Sequential(nn.Linear(fan_in, fan_out)).to(device)
    variants = {"bf16": base}
    for recipe in ("tensorwise", "rowwise"):
        layer = copy.deepcopy(base)
        to_float8([layer], recipe, "all")
        variants[recipe] = layer
    x = torch.randn(rows, fan_in, device=device, requires_grad=True)
    grad = torch.randn(rows, fan_out, device=device, dtype=torch.bfloat16)
    steps_of = {}
    for name, layer in variants.items():
        run = torch.compile(layer) if compile_ else layer

        def step(run=run):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = run(x)
            out.backward(grad.to(out.dtype))

        steps_of[name] = step
    watches = [CompileWatch()]
    with watches[0]:
        for step in steps_of.values():
            time_steps(step, 3, device)  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    for r in range(rounds):
        names = list(steps_of) if r % 2 == 0 else list(steps_of)[::-1]
        for name in names:
            with CompileWatch(timed=compile_) as watch:
                times[name] += time_steps(steps_of[name], steps, device)
            watches.append(watch)
    faults = [f for w in watches for f in w.faults]
    if faults:
        raise RuntimeError(
            f"{rows} x {fan_in} x {fan_out}: torch.compile {'; '.join(faults)}: not a compiled time"
        )
    return {name: statistics.median(t) for name, t in times.items()}


def torchao_picks(fan_in: int, fan_out: int, recipe: str) -> bool:
    """Whether trainer.fp8_layers=auto (torchao's filter) converts a layer of this shape."""
    from visiondist.engine.fp8 import layer_filter

    return bool(layer_filter(recipe)(nn.Linear(fan_in, fan_out, device="meta"), "layer"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        nargs="+",
        default=["vit_base:256", "vit_large:128", "vit_huge:64"],
        help="model:batch pairs (batch per GPU)",
    )
    parser.add_argument("--img", type=int, default=224)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--no-compile", action="store_true", help="eager layers (float8's casts unfused)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="2 images of 32 px, 2 steps x 2 rounds: the code path"
    )
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args()
    if args.tiny:
        args.models, args.img, args.steps, args.rounds = ["vit_tiny:2"], 32, 2, 2
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"float8 per linear layer on {name}, torch {torch.__version__}, {args.img} px, forward + "
        f"backward, {'eager' if args.no_compile else 'compiled'}, median of {args.rounds} x "
        f"{args.steps} steps",
        "",
        "| model | layer | rows x in x out | bf16 ms | tensorwise | rowwise |",
        "|---|---|---|---|---|---|",
    ]
    failed = 0
    print("\n".join(lines), flush=True)  # the rows follow as they are measured
    for spec in args.models:
        model, batch = spec.split(":")
        for layer, rows, fan_in, fan_out in layer_shapes(model, int(batch), args.img):
            picks = {
                r: " (auto: converts)" if torchao_picks(fan_in, fan_out, r) else " (auto: bf16)"
                for r in ("tensorwise", "rowwise")
            }
            try:
                t = time_layer(
                    rows, fan_in, fan_out, device, args.steps, args.rounds, not args.no_compile
                )
            except RuntimeError as error:  # the row failed, naming why; the others run on
                failed += 1
                lines.append(
                    f"| {model} | {layer} | {rows} x {fan_in} x {fan_out} | FAILED: {error} | | |"
                )
            else:
                lines.append(
                    f"| {model} | {layer} | {rows} x {fan_in} x {fan_out} | {t['bf16'] * 1e3:.3f} "
                    f"| {t['bf16'] / t['tensorwise']:.2f}x{picks['tensorwise']} | "
                    f"{t['bf16'] / t['rowwise']:.2f}x{picks['rowwise']} |"
                )
            print(lines[-1], flush=True)
    lines += [
        "",
        "tensorwise / rowwise: bf16's time over float8's (above 1: float8 is faster); auto: what "
        "trainer.fp8_layers=auto (torchao's filter) does with such a layer",
    ]
    print("\n".join(lines[-2:]))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    return failed


if __name__ == "__main__":
    sys.exit(main())
