"""Bubble of torch's pipeline schedules, measured from per-rank timelines of equal-cost stages.

Each of `pp` local ranks (gloo) holds stages of equal cost; the per-rank work is the same for every
schedule (a rank with two virtual stages gets two halves). One step runs `microbatches`
micro-batches through the schedule while every rank records when each forward (F), backward (B),
input-gradient (I) and weight-gradient (W) action starts and ends; the bubble is the idle share of
ranks x span (`visiondist.parallel.timeline`). Prints a table with the ideal (p - 1) / (m + p - 1)
of GPipe and 1F1B next to the measurements, and writes one timeline PNG per schedule.

Stage cost:
- `emulated` (default): a stage's forward waits `--ms` ms and its backward 2x that (input and weight
  halves apart, so zero-bubble can split them), as a GPU kernel would keep the device busy while the
  CPU waits. The activations and gradients still travel between processes through the real schedule.
  The measurement is then the schedule's, whatever the number of CPU cores.
- `compute`: real matmuls (Linear layers, one thread per rank). Meaningful only with a core per
  rank.

    python benchmarks/pipeline_bubble.py  # p=4, m=8, emulated, PNGs into benchmarks/
    python benchmarks/pipeline_bubble.py --cost compute --pp 2 --microbatches 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn

from visiondist.config.layout import MULTI_STAGE, SCHEDULES
from visiondist.launch import spawn_local
from visiondist.parallel.schedules import build_schedule
from visiondist.parallel.stages import stage_indices
from visiondist.parallel.timeline import Recorder, bubble_fraction, ideal_bubble, plot_timeline

WIDTH = 256  # activation width


class _Wait(torch.autograd.Function):
    """Identity that takes `forward_s` seconds forward and `backward_s` backward."""

    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class EmulatedStage(nn.Module):
    """F = t; I = t on the input path and W = t on the weight path (B = I + W = 2t)."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        # on the input path: the first stage has a backward too
        self.scale = nn.Parameter(torch.ones(()))
        self.bias = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x):
        t = self.seconds
        return _Wait.apply(x * self.scale, t, t) + _Wait.apply(self.bias, 0.0, t)


class ComputeStage(nn.Sequential):
    def __init__(self, layers: int):
        super().__init__(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def _stage(cost: str, per_rank_ms: float, per_rank_layers: int, spr: int) -> nn.Module:
    if cost == "emulated":
        return EmulatedStage(per_rank_ms / 1e3 / spr)
    return ComputeStage(max(1, per_rank_layers // spr))


def _loss(output, target):
    return ((output - target) ** 2).mean()


def _measure(
    name: str, spr: int, microbatches: int, cost: str, ms: float, layers: int, rows: int, steps: int
) -> dict:
    pp, rank = dist.get_world_size(), dist.get_rank()
    n = pp * spr
    ids = stage_indices(rank, pp, spr)
    torch.manual_seed(0)
    stages = [_stage(cost, ms, layers, spr) for _ in ids]
    recorder = Recorder(rank, torch.device("cpu"))
    schedule = build_schedule(
        name, stages, ids, n, microbatches, torch.device("cpu"), None, _loss, recorder
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(microbatches * rows, WIDTH, generator=g)
    y = torch.randn(microbatches * rows, WIDTH, generator=g)
    runs = []
    for step in range(steps + 2):  # two warm-up steps: buffers, shape inference
        for s in stages:
            s.zero_grad(set_to_none=True)
        with recorder.record(barrier=dist.barrier):
            schedule.step(*((x,) if 0 in ids else ()), target=y if n - 1 in ids else None)
        if step >= 2:
            runs.append(list(recorder.events))
    gathered = [None] * pp
    dist.all_gather_object(gathered, runs)
    return {"steps": [[e for r in range(pp) for e in gathered[r][k]] for k in range(steps)]}


def _run(cases, microbatches, cost, ms, layers, rows, steps):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        return {
            name: _measure(name, spr, microbatches, cost, ms, layers, rows, steps)
            for name, spr in cases
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--cost", choices=("emulated", "compute"), default="emulated")
    parser.add_argument(
        "--ms", type=float, default=40.0, help="emulated: forward ms of a rank's stage(s)"
    )
    parser.add_argument("--layers", type=int, default=16, help="compute: Linear layers per rank")
    parser.add_argument(
        "--rows", type=int, default=64, help="rows of a micro-batch (activations: rows x 256)"
    )
    parser.add_argument(
        "--stages-per-rank",
        type=int,
        default=2,
        help="of the interleaved and zero-bubble schedules",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedules", nargs="*", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = [(name, args.stages_per_rank if name in MULTI_STAGE else 1) for name in args.schedules]
    results = spawn_local(
        _run,
        args.pp,
        cases,
        args.microbatches,
        args.cost,
        args.ms,
        args.layers,
        args.rows,
        args.steps,
    )[0]

    p, m = args.pp, args.microbatches
    what = (
        f"{args.ms:g} ms forward per rank"
        if args.cost == "emulated"
        else f"{args.layers} Linear({WIDTH}) per rank"
    )
    print(
        f"\npipeline bubble, p={p}, m={m}, {args.cost} stages ({what}), median of {args.steps} "
        "steps"
    )
    print(
        f"{'schedule':<18} {'stages/rank':>11} {'step (ms)':>10} {'bubble':>8} {'ideal':>7}  "
        "timeline"
    )
    for name, spr in cases:
        stats = [bubble_fraction(events, p) for events in results[name]["steps"]]
        order = sorted(range(len(stats)), key=lambda k: stats[k]["bubble"])
        median = order[len(order) // 2]
        s = stats[median]
        ideal = ideal_bubble(p, m) if spr == 1 else ideal_bubble(p, m * spr)
        png = plot_timeline(
            results[name]["steps"][median],
            args.out / f"pipeline_{name}_p{p}_m{m}_{args.cost}.png",
            f"{name}: p={p}, m={m}, {p * spr} stages, {args.cost}",
        )
        ideal_text = f"{100 * ideal:6.1f}%" if name != "zero_bubble" else "      -"
        print(
            f"{name:<18} {spr:>11} {1e3 * s['span_s']:>10.1f} {100 * s['bubble']:>7.1f}% "
            f"{ideal_text}  {png.name}"
        )
    print(
        "ideal: (p - 1) / (m + p - 1); interleaved with v stages per rank: (p - 1) / (v m + p - 1)"
    )


if __name__ == "__main__":
    main()
