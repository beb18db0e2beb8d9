"""How long a checkpoint holds up training: synchronous vs asynchronous saves
(`trainer.checkpoint_async`), side by side in one process.

    python benchmarks/checkpoint_stall.py --model base large [--rounds 3] [--dir /tmp/ckpt_bench]

For each model: a ViT with AdamW state (fp32 weights + two moments, as a run checkpoints them),
trained on random 112-px images. Each round, in alternating order, saves once the synchronous way
and once the asynchronous way through `visiondist.checkpoint.dcp.save_checkpoint` (what the trainer
calls), then trains `--steps` steps:

- stall: seconds from the save's call until training may go on (sync: the whole write; async: the
  copy to host memory, plus waiting for a previous save, of which there is none here);
- the steps after it: their time, against steps with no write underway (the background write shares
  the CPU and the disk with training);
- exposed: stall plus the extra step time, the real cost of one checkpoint to the run.

Prints one table per model and appends a row to benchmarks/results.jsonl.
"""

import argparse
import datetime
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from visiondist.checkpoint.dcp import PendingSave, save_checkpoint
from visiondist.checkpoint.state import init_optimizer_state
from visiondist.models.vit import VisionTransformer

SHAPES = {"base": (768, 12, 12), "large": (1024, 24, 16)}  # embed dim, depth, heads (patch 16)


def build(model: str, img: int):
    torch.manual_seed(0)
    dim, depth, heads = SHAPES[model]
    vit = VisionTransformer(img, 16, 1000, dim, depth, heads)
    optimizer = torch.optim.AdamW(vit.parameters(), lr=1e-4)
    init_optimizer_state(optimizer)
    return vit, optimizer


def train_steps(vit, optimizer, images, labels, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(vit(images), labels).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", nargs="+", choices=list(SHAPES), default=["base", "large"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps timed after each save")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--img", type=int, default=112)
    parser.add_argument("--dir", default="/tmp/checkpoint_stall")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29563")
    # a one-rank run, as tools/train.py starts it
    dist.init_process_group("gloo", rank=0, world_size=1)
    layout = SimpleNamespace(is_main=True, rank=0, world_size=1, dp=1, tp=1, pp=1, mesh=None)
    root = Path(args.dir)
    for name in args.model:
        vit, optimizer = build(name, args.img)
        params = sum(p.numel() for p in vit.parameters())
        images = torch.randn(args.batch, 3, args.img, args.img)
        labels = torch.randint(0, 1000, (args.batch,))
        train_steps(vit, optimizer, images, labels, 2)  # warm-up
        rows = {"sync": [], "async": []}
        quiet = []
        step = 0
        for r in range(args.rounds):
            quiet += train_steps(vit, optimizer, images, labels, args.steps)  # no write underway
            for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                shutil.rmtree(root, ignore_errors=True)
                step += 1
                start = time.perf_counter()
                saved = save_checkpoint(
                    root,
                    step,
                    vit,
                    optimizer,
                    {"bench": True},
                    layout,
                    keep_last=1,
                    async_group=False if mode == "sync" else None,
                )
                stall = time.perf_counter() - start
                after = train_steps(vit, optimizer, images, labels, args.steps)
                pending = time.perf_counter()
                if isinstance(saved, PendingSave):
                    saved.wait()
                # write time not yet hidden after the timed steps
                left = time.perf_counter() - pending
                rows[mode].append({"stall_s": stall, "steps_s": after, "left_s": left})
        step_s = statistics.median(quiet)
        summary = {}
        for mode, entries in rows.items():
            stall = statistics.median(e["stall_s"] for e in entries)
            extra = statistics.median(sum(e["steps_s"]) - args.steps * step_s for e in entries)
            left = statistics.median(e["left_s"] for e in entries)
            summary[mode] = {
                "stall_s": stall,
                "stall_min_s": min(e["stall_s"] for e in entries),
                "stall_max_s": max(e["stall_s"] for e in entries),
                "extra_step_s": extra,
                "exposed_s": stall + max(extra, 0.0),
                "unhidden_after_steps_s": left,
            }
        size_gb = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 1e9
        print(
            f"\nViT-{name[0].upper()}/16 ({params / 1e6:.0f}M parameters, checkpoint "
            f"{size_gb:.2f} GB), step {step_s:.2f} s (batch {args.batch}, {args.img} px), "
            f"{args.rounds} rounds, medians:"
        )
        print(
            f"{'':8}{'stall (s)':>12}{'min-max':>14}{'extra step time (s)':>22}{'exposed (s)':>14}"
        )
        for mode, m in summary.items():
            print(
                f"{mode:8}{m['stall_s']:12.2f}{m['stall_min_s']:7.2f}-{m['stall_max_s']:<6.2f}"
                f"{m['extra_step_s']:22.2f}{m['exposed_s']:14.2f}"
            )
        ratio = summary["sync"]["stall_s"] / summary["async"]["stall_s"]
        exposed = summary["sync"]["exposed_s"] / summary["async"]["exposed_s"]
        print(f"stall sync / async: {ratio:.1f}x; exposed cost sync / async: {exposed:.1f}x")
        with open(Path(__file__).with_name("results.jsonl"), "a") as f:
            f.write(
                json.dumps(
                    {
                        "date": datetime.date.today().isoformat(),
                        "benchmark": "checkpoint_stall",
                        "device": f"CPU, {torch.get_num_threads()} threads",
                        "torch": torch.__version__,
                        "model": f"vit_{name}",
                        "params": params,
                        "checkpoint_gb": size_gb,
                        "step_s": step_s,
                        "rounds": args.rounds,
                        **summary,
                        "stall_ratio": ratio,
                        "exposed_ratio": exposed,
                    }
                )
                + "\n"
            )
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
