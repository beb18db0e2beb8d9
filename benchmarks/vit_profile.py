"""Where a ViT training step's time goes on one GPU: visiondist's ViT against timm's, each in the
same plain loop (forward under bf16 autocast, cross-entropy, backward, fused AdamW), under the ways
of compiling it side by side.

Variants (`--variants`, any of):
- timm_eager, timm_blocks, timm_whole: timm's ViT eager, compiled block by block, compiled whole
  (timm's train.py);
- split_eager, split_blocks: ours with q, k and v run as three GEMMs (`Attention.fuse_qkv = False`);
- ours_eager, ours_blocks, ours_whole: ours as it runs (q, k, v as one GEMM);
- ours_whole_cudagraphs: ours compiled whole with mode="reduce-overhead" (CUDA graphs).

Each row is timed in rounds that alternate between the variants (the median round is the row's
rate), then profiled for a few steps: kernels per step, GPU time by kind (matmul, attention, fused
Triton, eager elementwise / norm, optimizer, copies), the top kernels, and the GPU's idle share of
the step. Dynamo's counters are read per variant: a graph break or a recompile-limit hit fails the
variant naming the cause (torch's `fail_on_recompile_limit_hit`), instead of timing eager code as if
it were compiled.

    python benchmarks/vit_profile.py --rows vit_small:256 vit_base:256:timm_whole,ours_whole \
        --out benchmarks/gpu/out
    python benchmarks/vit_profile.py --tiny --device cpu  # the whole path on the CPU, tiny settings
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # name: (timm name, patch, dim, depth, heads)
    "vit_tiny": ("vit_tiny_patch16_224", 16, 192, 12, 3),
    "vit_small": ("vit_small_patch16_224", 16, 384, 12, 6),
    "vit_base": ("vit_base_patch16_224", 16, 768, 12, 12),
    "vit_large": ("vit_large_patch16_224", 16, 1024, 24, 16),
    "vit_huge": ("vit_huge_patch14_224", 14, 1280, 32, 16),
}
VARIANTS = (
    "timm_eager",
    "timm_blocks",
    "timm_whole",
    "split_eager",
    "split_blocks",
    "ours_eager",
    "ours_blocks",
    "ours_whole",
    "ours_whole_cudagraphs",
)

KINDS = [  # (kind, pattern on the kernel's name), first match wins
    ("attention", r"flash|fmha|attention|sdpa|mha"),
    ("optimizer", r"multi_tensor|fused_adam|adamw|foreach"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|splitk|conv|implicit|wgmma|sm90_"),
    ("fused triton", r"^triton"),
    ("copies", r"memcpy|memset|copy|cat"),
    ("eager elementwise / norm", r"elementwise|reduce|norm|softmax|gelu|bernoulli|index|fill"),
]


def build(variant: str, shape: str, tiny: bool, device: torch.device) -> torch.nn.Module:
    from visiondist.models.vit import Attention, VisionTransformer

    timm_name, patch, dim, depth, heads = SHAPES[shape]
    kwargs = dict(
        img_size=224,
        patch_size=patch,
        embed_dim=dim,
        depth=depth,
        num_heads=heads,
        num_classes=1000,
    )
    if tiny:
        kwargs.update(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10)
    if variant.startswith("timm"):
        import timm

        model = timm.create_model(timm_name, pretrained=False, **kwargs)
    else:
        model = VisionTransformer(**kwargs)
        for module in model.modules():
            if isinstance(module, Attention):
                module.fuse_qkv = not variant.startswith("split")
    return model.to(device).train()


class Loop:
    """The plain step for one variant; the compiled parts are built here, compiled on the first
    steps."""

    def __init__(self, variant: str, model: torch.nn.Module, device: torch.device):
        self.variant, self.model, self.device = variant, model, device
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-4, weight_decay=0.05, fused=device.type == "cuda"
        )
        scope = variant.split("_", 1)[1]
        forward = self._forward
        if scope == "blocks":
            for block in model.blocks:
                block.compile()
        elif scope == "whole":
            forward = torch.compile(forward)
        elif scope == "whole_cudagraphs":
            forward = torch.compile(forward, mode="reduce-overhead")
        self.forward, self.cudagraphs = forward, scope == "whole_cudagraphs"

    def _forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            out = self.model(x)
        return F.cross_entropy(out.float(), y)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        self.forward(x, y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    breaks = {reason: n for reason, n in counters["graph_break"].items()}
    return {
        "graphs": counters["stats"].get("unique_graphs", 0),
        "graph_breaks": sum(breaks.values()),
        "break_reasons": dict(list(breaks.items())[:5]),
        "cudagraph_skips": sum(v for k, v in counters["inductor"].items() if "cudagraph_skip" in k),
    }


def kernel_profile(loop: Loop, x, y, steps: int) -> dict:
    """A few profiled steps: kernels per step, GPU time by kind, the top kernels, the GPU's idle
    share."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if loop.device.type == "cuda" else []
    )
    sync(loop.device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            loop.step(x, y)
        sync(loop.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels = [
        e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e
    ]
    if not kernels:
        return {"kernels_per_step": 0}
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    wall = spans[-1][1] - spans[0][0]
    by_kind: dict[str, float] = {}
    by_name: dict[str, list] = {}
    for e in kernels:
        name = e["name"]
        kind = next((k for k, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)), "other")
        if e.get("cat") != "kernel":
            kind = "copies"
        by_kind[kind] = by_kind.get(kind, 0.0) + float(e["dur"])
        entry = by_name.setdefault(name, [0, 0.0, kind])
        entry[0] += 1
        entry[1] += float(e["dur"])
    total = sum(by_kind.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:8]
    return {
        "kernels_per_step": len(kernels) / steps,
        "gpu_ms_per_step": total / steps / 1e3,
        "span_ms_per_step": wall / steps / 1e3,
        "idle_share": 1.0 - busy / wall if wall else 0.0,
        "kinds": {
            k: round(v / total, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "top": [
            {
                "name": n[:90],
                "calls_per_step": c / steps,
                "ms_per_step": round(t / steps / 1e3, 3),
                "share": round(t / total, 4),
                "kind": k,
            }
            for n, (c, t, k) in top
        ],
    }


def run_row(shape: str, batch: int, variants: list[str], args) -> list[dict]:
    import torch._dynamo

    device = torch.device(args.device)
    size = 32 if args.tiny else 224
    classes = 10 if args.tiny else 1000
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=generator).to(device)
    y = torch.randint(0, classes, (batch,), generator=generator).to(device)
    loops, rows = {}, {}
    from torch._dynamo.utils import counters

    for variant in variants:
        # dynamo's caches stay: the variants are timed in turns after all were built
        counters.clear()
        row = {"row": f"{shape} b{batch}", "variant": variant}
        rows[variant] = row
        try:
            loop = Loop(variant, build(variant, shape, args.tiny, device), device)
            sync(device)
            start = time.perf_counter()
            loop.step(x, y)
            sync(device)
            first = time.perf_counter() - start
            for _ in range(args.warmup):
                loop.step(x, y)
            sync(device)
            start = time.perf_counter()
            loop.step(x, y)
            sync(device)
            row["first_step_s"] = round(first, 2)
            row["compile_s"] = round(first - (time.perf_counter() - start), 2)
            row.update(dynamo_counters())
            if "eager" not in variant and row["graph_breaks"]:
                raise RuntimeError(f"{row['graph_breaks']} graph breaks: {row['break_reasons']}")
            loops[variant] = loop
        except Exception as error:  # the variant fails, naming why; the others run on
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            print(f"{shape} {variant}: {row['error']}", flush=True)
        gc.collect()
    times: dict[str, list[float]] = {v: [] for v in loops}
    # alternate: every variant sees the same machine state in each round
    for _ in range(args.rounds):
        for variant, loop in list(loops.items()):
            graphs = counters["stats"].get("unique_graphs", 0)
            sync(device)
            start = time.perf_counter()
            try:
                for _ in range(args.steps):
                    loop.step(x, y)
                sync(device)
            except Exception as error:  # e.g. the recompile limit, hit while timed
                rows[variant]["error"] = (
                    f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                )
                del loops[variant], times[variant]
                continue
            times[variant].append(time.perf_counter() - start)
            # compiled again while timed: not a rate
            if counters["stats"].get("unique_graphs", 0) > graphs:
                rows[variant]["recompiled_while_timed"] = (
                    counters["stats"]["unique_graphs"] - graphs
                )
    for variant, loop in loops.items():
        row = rows[variant]
        row["img_per_s"] = round(batch * args.steps / statistics.median(times[variant]), 1)
        row["rounds_img_per_s"] = [round(batch * args.steps / t, 1) for t in times[variant]]
        row["profile"] = kernel_profile(loop, x, y, args.profile_steps)
        print(json.dumps(row), flush=True)
    del loops
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return list(rows.values())


def markdown(rows: list[dict], device: str) -> str:
    lines = [
        f"Device: {device}",
        "",
        "| row | variant | img/s | / timm_whole | compile s | graphs | kernels / step | GPU idle "
        "| matmul | attention | fused triton | eager elementwise | optimizer | copies |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    best = {r["row"]: r.get("img_per_s") for r in rows if r["variant"] == "timm_whole"}
    for r in rows:
        if "recompiled_while_timed" in r:
            r = {**r, "error": f"compiled again while timed ({r['recompiled_while_timed']} graphs)"}
        if "error" in r:
            lines.append(f"| {r['row']} | {r['variant']} | failed: {r['error']} |" + " |" * 11)
            continue
        p, kinds = r.get("profile", {}), r.get("profile", {}).get("kinds", {})
        ratio = f"{r['img_per_s'] / best[r['row']]:.3f}" if best.get(r["row"]) else ""
        share = lambda k, kinds=kinds: f"{100 * kinds.get(k, 0):.1f}%"  # noqa: E731
        lines.append(
            f"| {r['row']} | {r['variant']} | {r['img_per_s']:,.0f} | {ratio} | "
            f"{r.get('compile_s', '')} | {r.get('graphs', '')} | "
            f"{p.get('kernels_per_step', 0):.0f} | {100 * p.get('idle_share', 0):.1f}% | "
            f"{share('matmul')} | {share('attention')} | {share('fused triton')} | "
            f"{share('eager elementwise / norm')} | {share('optimizer')} | {share('copies')} |"
        )
    lines += ["", "Top kernels per variant (ms per step, share of GPU time):", ""]
    for r in rows:
        for k in r.get("profile", {}).get("top", [])[:6]:
            lines.append(
                f"- {r['row']} {r['variant']}: {k['ms_per_step']:.3f} ms ({100 * k['share']:.1f}%, "
                f"{k['calls_per_step']:.0f}x, {k['kind']}) `{k['name']}`"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        nargs="+",
        default=["vit_small:256", "vit_base:256"],
        help="model:batch[:variant,...], model one of " + ", ".join(SHAPES),
    )
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-block ViT on 32 px images (a check of the path)"
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument(
        "--out", default=None, help="folder for vit_profile.json and vit_profile.md"
    )
    args = parser.parse_args()
    import torch._dynamo.config as dynamo_config

    # a hit raises instead of running eager
    if hasattr(dynamo_config, "fail_on_recompile_limit_hit"):
        dynamo_config.fail_on_recompile_limit_hit = True
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    rows = []
    for spec in args.rows:
        shape, batch, *only = spec.split(":")
        variants = only[0].split(",") if only else args.variants
        unknown = sorted(set(variants) - set(VARIANTS))
        if unknown or shape not in SHAPES:
            parser.error(f"--rows {spec}: unknown {unknown or shape}")
        rows += run_row(shape, int(batch), variants, args)
    text = markdown(rows, f"{device}, torch {torch.__version__}")
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "vit_profile.json").write_text(json.dumps(rows, indent=1))
        (out / "vit_profile.md").write_text(text)
    return sum("error" in r or "recompiled_while_timed" in r for r in rows)


if __name__ == "__main__":
    sys.exit(main())
