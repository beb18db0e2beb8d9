"""One optimizer step per kernel (fused / foreach / loop) over a ViT's parameters, side by side.

    python benchmarks/optimizer_kernels.py --model small --optimizer adamw [--fsdp] [--rounds 6]

Random gradients, visiondist's decay / no-decay groups; each kernel steps 5 times per round, the
kernels in alternating order from round to round; prints the median, min and max of each. `--fsdp`
shards the model with FSDP2 over one rank first (DTensor parameters, as `parallel.fsdp` trains
them). This is what `optim.impl=auto` was chosen from (benchmarks/RESULTS.md).
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from visiondist.engine.optim import KERNELS, param_groups
from visiondist.models.vit import VisionTransformer

# embed dim, heads; 12 blocks, 224 px, 100 classes
SHAPES = {"tiny": (192, 3), "small": (384, 6), "base": (768, 12)}


def build(model: str, optimizer: str, kernel: str, fsdp: bool) -> torch.optim.Optimizer:
    torch.manual_seed(0)
    dim, heads = SHAPES[model]
    vit = VisionTransformer(224, 16, 100, dim, 12, heads)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        for block in vit.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(vit, mesh=mesh)
    for p in vit.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    groups = param_groups(vit, 0.05)
    if optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=1e-3, **KERNELS[kernel])
    return torch.optim.SGD(groups, lr=1e-3, momentum=0.9, **KERNELS[kernel])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=list(SHAPES), default="small")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if args.fsdp:
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    kernels = list(KERNELS)
    runs = {}
    for kernel in kernels:
        try:
            runs[kernel] = (build(args.model, args.optimizer, kernel, args.fsdp), [])
            runs[kernel][0].step()  # creates the state
        except RuntimeError as exc:  # e.g. fused SGD on DTensors
            print(f"{kernel}: not available here ({str(exc).splitlines()[0]})")
            runs.pop(kernel, None)
    for index in range(args.rounds):
        for kernel in kernels if index % 2 == 0 else kernels[::-1]:
            if kernel in runs:
                optimizer, times = runs[kernel]
                for _ in range(5):
                    start = time.perf_counter()
                    optimizer.step()
                    times.append(time.perf_counter() - start)
    where = " under FSDP" if args.fsdp else ""
    print(
        f"ViT-{args.model[0].upper()}, {args.optimizer}{where}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {5 * args.rounds} steps each:"
    )
    for kernel, (_, times) in runs.items():
        print(
            f"  {kernel:8s} median {1e3 * statistics.median(times):7.2f} ms, min "
            f"{1e3 * min(times):7.2f}, max {1e3 * max(times):7.2f}"
        )
    if args.fsdp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
