"""Step time of tensor parallelism: visiondist's collective autograd functions (with and without
sequence parallelism) vs DTensor `parallelize_module`.

Same model, same Megatron split (q/k/v and fc1 column-wise, proj and fc2 row-wise), forward +
backward + AdamW, on `tp` local ranks (gloo on the CPU). Prints a table: median ms/step of each and
their ratio.

    python benchmarks/tp_step_time.py            # tp 2 and 4, a ViT-Ti-sized model with 4 heads
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from visiondist.launch import spawn_local
from visiondist.models.vit import VisionTransformer
from visiondist.parallel import build_layout, clip_grad_norm, finish_gradients, parallelize

KINDS = ("functions", "functions+SP", "dtensor")
MODEL = dict(img_size=64, patch_size=16, num_classes=10, embed_dim=192, depth=6, num_heads=4)


def _dtensor(model, layout):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {}
    for i in range(len(model.blocks)):
        plan.update({f"blocks.{i}.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")})
        plan.update(
            {
                f"blocks.{i}.attn.proj": RowwiseParallel(),
                f"blocks.{i}.mlp.fc1": ColwiseParallel(),
                f"blocks.{i}.mlp.fc2": RowwiseParallel(),
            }
        )
    return parallelize_module(model, layout.mesh["tp"], plan)


def _time(kind: str, tp: int, steps: int, batch: int) -> list[float]:
    layout = build_layout(1, tp, 1, torch.device("cpu"), 0)
    torch.manual_seed(0)
    model = VisionTransformer(**MODEL)
    ours = kind != "dtensor"
    model = (
        parallelize(model, layout, sequence_parallel=kind == "functions+SP")
        if ours
        else _dtensor(model, layout)
    )
    # DTensor parameters break foreach AdamW and the global-norm clip ("mixed torch.Tensor and
    # DTensor")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=ours)
    images, labels = torch.randn(batch, 3, 64, 64), torch.randint(0, 10, (batch,))
    times = []
    for _ in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(images), labels).backward()
        if ours:
            finish_gradients(model.parameters(), layout)
            clip_grad_norm(model.parameters(), 1.0, layout)
        opt.step()
        times.append(time.perf_counter() - start)
    return times[2:]  # the first two steps warm up allocators and gloo


def _rank(tp: int, steps: int, batch: int) -> dict:
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    try:
        return {kind: statistics.median(_time(kind, tp, steps, batch)) * 1e3 for kind in KINDS}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    print(
        f"ViT {MODEL}, batch {args.batch}, fwd+bwd+AdamW, median of {args.steps} steps, "
        f"{os.cpu_count()} CPU cores"
    )
    print(
        "| tp | functions (ms/step) | functions + SP (ms/step) | DTensor (ms/step) | DTensor / "
        "functions |"
    )
    print("|---|---|---|---|---|")
    for tp in args.tp:
        r = spawn_local(_rank, tp, tp, args.steps, args.batch)[0]
        f, sp, d = r["functions"], r["functions+SP"], r["dtensor"]
        print(f"| {tp} | {f:.1f} | {sp:.1f} | {d:.1f} | {d / f:.2f} |", flush=True)


if __name__ == "__main__":
    main()
