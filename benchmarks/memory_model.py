"""The memory plan against measurement.

CPU (default): the bytes of the tensors autograd saves for the backward of a ViT's blocks
(saved-tensor hooks, distinct storages, parameters left out), next to `block_activation_bytes`.

CUDA (`--device cuda`): the training step itself, through `tools/benchmark.py` (the real Trainer on
synthetic batches on the device, eager, no plain loops): ViT-B/16, ViT-L/16 and ViT-H/14 at 224 px
in bf16 in one process each, plain, accumulated (`trainer.grad_accum=4`), checkpointed (whole
blocks) and checkpointed keeping the matmuls; then ViT-B/16 under tp2 and pp2 with both ranks on the
one GPU (`trainer.share_gpu`, rank 0). Each row: the plan's bytes for the same layout (`planned_gb`,
what tools/plan.py and the fit of a named layout count) against the step's peak
`max_memory_allocated` and `max_memory_reserved`; a row whose allocated peak is more than 10% off
the plan is marked, and the largest reserved / planned says what the budget's headroom
(`parallel.headroom`, 0.9) must cover. The exit code is the number of marked rows. `--smoke` runs
the same commands with a tiny ViT on the CPU (where the peak is the process's RSS, not comparable),
to check them.

    python benchmarks/memory_model.py                     # CPU, fp32
    python benchmarks/memory_model.py --device cuda --out benchmarks/gpu/out/memory
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from visiondist.models.shape import ViTShape
from visiondist.models.vit import VisionTransformer
from visiondist.plan.measured import saved_activation_bytes
from visiondist.plan.memory import block_activation_bytes

SHAPES = {  # name: (embed_dim, depth, heads, img, patch, batch)
    "vit_tiny/16 @224": (192, 12, 3, 224, 16, 32),
    "vit_small/16 @224": (384, 12, 6, 224, 16, 32),
    "vit_base/16 @224": (768, 12, 12, 224, 16, 16),
    "vit_large/16 @224": (1024, 24, 16, 224, 16, 8),
}


def cpu_row(name, dim, depth, heads, img, patch, batch) -> str:
    model = VisionTransformer(
        img_size=img,
        patch_size=patch,
        num_classes=1000,
        embed_dim=dim,
        depth=depth,
        num_heads=heads,
    )
    tokens = model.embed(torch.randn(batch, 3, img, img)).detach().requires_grad_()
    measured = saved_activation_bytes(model.blocks, tokens)
    estimate = depth * block_activation_bytes(
        ViTShape(dim, depth, heads, 4.0, patch, img, 1000), batch, 1
    )
    return (
        f"| {name} | {batch} | {measured / 1e6:.1f} | {estimate / 1e6:.1f} | "
        f"{estimate / measured:.3f} |"
    )


REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.10  # the allocated peak within this of the plan
STEP = [
    "data.img_size=224",
    "trainer.precision=bf16",
    "trainer.compile=false",
    "bench.baseline=false",
    "bench.peak=false",
    "bench.loader_batches=0",
    "bench.warmup=2",
    "bench.steps=3",
    "bench.rounds=1",
]
CHECKPOINTED = [
    "parallel.activation_checkpointing=true",
    "parallel.activation_checkpointing=true parallel.checkpoint_keep=matmuls",
]
# name: tools/benchmark.py overrides and the variants timed beside them in the same process
# (accumulation changes the batch the variants share: a process of its own)
ROWS = {
    # JPEGs decoded in the loader: what the device's decoding (data.decode_on=auto picks it on a
    # GPU) adds to the step's peak, which the plan does not count
    "vit_base": (
        ["model=vit_base", "data.batch_size=256"],
        [*CHECKPOINTED, "data.decode_on=loader"],
    ),
    "vit_base+accum": (["model=vit_base", "data.batch_size=256", "trainer.grad_accum=4"], []),
    "vit_large": (["model=vit_large", "data.batch_size=128"], CHECKPOINTED),
    "vit_large+accum": (["model=vit_large", "data.batch_size=128", "trainer.grad_accum=4"], []),
    "vit_huge": (["model=vit_huge", "data.batch_size=64"], CHECKPOINTED),
    "vit_huge+accum": (["model=vit_huge", "data.batch_size=64", "trainer.grad_accum=4"], []),
    "vit_base+tp2": (
        ["model=vit_base", "data.batch_size=256", "parallel=tp2", "trainer.share_gpu=true"],
        CHECKPOINTED[:1],
    ),  # both ranks on the one GPU: rank 0's peak
    "vit_base+pp2": (
        ["model=vit_base", "data.batch_size=256", "parallel=pp2", "trainer.share_gpu=true"],
        CHECKPOINTED[:1],
    ),
}
SMOKE = [
    "model=vit_tiny",
    "model.depth=2",
    "model.num_heads=2",
    "data.img_size=32",
    "data.batch_size=8",
    "trainer.precision=32",
    "trainer.accelerator=cpu",
]


def step_rows(device: str, out: Path, smoke: bool, names: list[str]) -> list[dict]:
    """Run each of ROWS named (all: empty) through tools/benchmark.py, its variants beside it, and
    read back its results rows."""
    import json
    import subprocess

    rows = []
    for name, (overrides, variants) in ROWS.items():
        if names and name not in names:
            continue
        results = out / name.replace("+", "_")
        if smoke:  # the CPU's ranks are processes of their own
            overrides = [
                o.replace("trainer.share_gpu=true", "trainer.devices=2") for o in overrides
            ]
        args = [
            *STEP,
            *overrides,
            *(SMOKE if smoke else [f"trainer.accelerator={device}"]),
            f"bench.results_dir={results}",
            f"bench.variants={json.dumps(variants)}",
        ]
        print(f"$ python tools/benchmark.py {' '.join(args)}", flush=True)
        done = subprocess.run(
            [sys.executable, str(REPO / "tools" / "benchmark.py"), *args], cwd=REPO
        )
        if done.returncode:
            rows.append({"name": name, "failed": done.returncode})
            continue
        rows += [
            {"name": name, **json.loads(line)}
            for line in (results / "results.jsonl").read_text().splitlines()
        ]
    return rows


def step_table(rows: list[dict]) -> int:
    """Print the plan against the peaks; the number of rows off the plan (or failed)."""
    print(
        "| run | variant | batch | planned GB | max allocated GB | allocated / planned | max "
        "reserved GB | reserved / planned |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    off, worst = 0, 0.0
    for r in rows:
        if "failed" in r:
            print(f"| {r['name']} | FAILED (exit {r['failed']}) | | | | | | |")
            off += 1
            continue
        planned, allocated, reserved = (
            r.get("planned_gb"),
            r.get("peak_memory_gb"),
            r.get("peak_reserved_gb"),
        )
        ratio = allocated / planned if planned and allocated else None
        marked = (
            ratio is not None
            and abs(ratio - 1) > TOLERANCE
            and r["device"].startswith("CPU") is False
        )
        off += marked
        if planned and reserved:
            worst = max(worst, reserved / planned)
        print(
            f"| {r['name']} | {r['variant']} | {r['batch']} | {_num(planned)} | {_num(allocated)} "
            f"| {_num(ratio, '.3f')}{' OFF' if marked else ''} | {_num(reserved)} | "
            f"{_num(reserved / planned if planned and reserved else None, '.3f')} |"
        )
    if worst:
        print(
            f"largest reserved / planned: {worst:.3f}; parallel.headroom=0.9 covers up to "
            f"{1 / 0.9:.3f}"
        )
    return off


def _num(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument(
        "--out",
        default="outputs/memory_model",
        help="where the benchmark's results go (CUDA, --smoke)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="the CUDA mode's commands, tiny, on the CPU"
    )
    ap.add_argument(
        "--rows", default="", help=f"comma-separated, of {', '.join(ROWS)} (default: all)"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.device == "cpu" and not args.smoke:
        print("| shape | batch | saved by autograd (MB) | estimate (MB) | estimate / measured |")
        print("| --- | --- | --- | --- | --- |")
        for name, dims in SHAPES.items():
            print(cpu_row(name, *dims), flush=True)
        return 0
    if not args.smoke:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    names = [n for n in args.rows.split(",") if n]
    unknown = sorted(set(names) - set(ROWS))
    if unknown:
        ap.error(f"--rows: unknown {', '.join(unknown)}; the rows are {', '.join(ROWS)}")
    return step_table(step_rows(args.device, Path(args.out), args.smoke, names))


if __name__ == "__main__":
    sys.exit(main())
