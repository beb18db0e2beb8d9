"""`tools/benchmark.py`: the training step's speed against the hardware and against a plain PyTorch loop.

Every rank builds the real `Trainer` (model, layout, optimizer, fast-path switches) and times `Trainer.train_step` on
synthetic batches that already sit on the device, so the figure is the step's and not the loader's. In the same
process, and interleaved with ours round by round, a *baseline* trains the same architecture (timm's ViT, or the same
torchvision detector) with a minimal plain-PyTorch loop: autocast, backward, optional clip, optimizer step, with the
same precision, optimizer kernels, clipping and, with `trainer.compile`, `torch.compile` of the whole model. The
ratio of the two median step times is visiondist's overhead (or gain).

Reported next to it: FLOPs per image counted by `torch.utils.flop_counter` on the unsharded model (forward +
backward), the achieved TFLOP/s per device, MFU against the device's dense matmul rate measured in the same run, peak
memory, the TP / pipeline traffic per step from their counters, and the real train loader's images/s on its own.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import resource
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from visiondist.engine.precision import autocast_dtype, autocast_for, precision_name
from visiondist.models import select_attention
from visiondist.parallel import Layout

log = logging.getLogger(__name__)


# -- measurements --------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], Any], n: int, device: torch.device) -> list[float]:
    """Seconds of each of `n` calls, the device drained before and after each."""
    times = []
    for _ in range(n):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...] | None = None,
                       repeats: int = 10) -> float:
    """Dense matmul rate of this device in `dtype`, in TFLOP/s: the best of `repeats` square products of each size
    (8192 on a GPU; 1024 and 2048 on the CPU, whose caches favour the smaller). On the CPU it uses this process's
    threads."""
    best = 0.0
    for size in sizes or ((8192,) if device.type == "cuda" else (1024, 2048)):
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        for _ in range(2):
            a @ b
        best = max(best, 2 * size**3 / min(time_steps(lambda: a @ b, repeats, device)) / 1e12)
    return best


def train_flops_per_image(model_cfg: DictConfig, batch: tuple, family: str) -> float:
    """FLOPs of one forward + backward per image, counted by `FlopCounterMode` on the unsharded model (a ViT on the
    meta device, costing nothing; a detector on the CPU, since its box sampling needs real values)."""
    from torch.utils.flop_counter import FlopCounterMode

    from visiondist.models import build_model

    cfg = model_cfg.copy()
    cfg.weights = cfg.init_from = None
    if family == "classification":
        images, labels = batch
        with torch.device("meta"):
            model = build_model(cfg)
        images, labels = images[:1].to("meta"), labels[:1].to("meta")
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(images), labels).backward()
        return float(counter.get_total_flops())
    images, targets = batch
    model = build_model(cfg).train()
    with FlopCounterMode(display=False) as counter:
        losses = model([images[0].cpu()], [{k: v.cpu() for k, v in targets[0].items()}])
        sum(losses.values()).backward()
    return float(counter.get_total_flops())


class PeakMemory:
    """CUDA: the peak of tensor memory since construction, above what was allocated then (what one configuration adds
    to a process that may hold others). The CPU has no such counter: `rss_gb` is the whole process's peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self.before = 0
        if device.type == "cuda":
            self.before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def increase_gb(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return (torch.cuda.max_memory_allocated(self.device) - self.before) / 1e9

    @staticmethod
    def rss_gb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU ({model}), {torch.get_num_threads()} threads"


def loader_images_per_s(loader, batches: int) -> float:
    """Images per second the real train loader delivers on its own (after its first batch: worker start-up)."""
    it = iter(loader)
    next(it)
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        try:
            batch = next(it)
        except StopIteration:
            break
        images += len(batch[0]) if batch[0] is not None else len(batch[1])
    return images / max(time.perf_counter() - start, 1e-9)


# -- synthetic batches ---------------------------------------------------------------------------------------------


def synthetic_batch(cfg: DictConfig, family: str, micro_batch: int, device: torch.device, seed: int = 0) -> tuple:
    """One micro-batch of random images and targets at the model's input size, on `device`."""
    g = torch.Generator().manual_seed(seed)
    if family == "classification":
        size = cfg.model.img_size
        images = torch.randn(micro_batch, 3, size, size, generator=g)
        labels = torch.randint(0, cfg.model.num_classes, (micro_batch,), generator=g)
        return images.to(device), labels.to(device)
    size = cfg.data.min_size  # detectors resize internally; square images of the short side
    images, targets = [], []
    for _ in range(micro_batch):
        images.append(torch.rand(3, size, size, generator=g).to(device))
        n = int(torch.randint(1, 5, (), generator=g))
        xy = torch.rand(n, 2, generator=g) * size * 0.6
        wh = torch.rand(n, 2, generator=g) * size * 0.3 + size * 0.05
        boxes = torch.cat([xy, xy + wh], dim=1)
        labels = torch.randint(1, cfg.model.num_classes + 1, (n,), generator=g)
        targets.append({"boxes": boxes.to(device), "labels": labels.to(device)})
    return images, targets


def _task_family(cfg: DictConfig) -> str:
    from visiondist.models import TASKS

    return TASKS[cfg.model.family]


# -- the baseline --------------------------------------------------------------------------------------------------


def baseline_model(cfg: DictConfig) -> torch.nn.Module:
    """The same architecture as plain PyTorch users build it: timm's ViT (random init, nothing downloaded), or the
    torchvision detector itself."""
    m = cfg.model
    if m.family == "vit":
        import timm

        if not m.timm_name:
            raise ValueError(f"model {m.name} names no timm architecture (model.timm_name): use bench.baseline=false")
        # timm's architecture with this config's shape (a depth or width override applies to both)
        return timm.create_model(m.timm_name, pretrained=False, num_classes=m.num_classes, img_size=m.img_size,
                                 patch_size=m.patch_size, embed_dim=m.embed_dim, depth=m.depth,
                                 num_heads=m.num_heads, mlp_ratio=m.mlp_ratio, qkv_bias=m.qkv_bias,
                                 drop_rate=m.drop_rate, drop_path_rate=m.drop_path_rate)
    from visiondist.models import build_model

    model_cfg = m.copy()
    model_cfg.weights = None
    return build_model(model_cfg)


class PlainLoop:
    """A minimal training loop in plain PyTorch: what a user writes by hand."""

    def __init__(self, cfg: DictConfig, device: torch.device):
        from visiondist.engine.optim import optimizer_kernels

        self.model = baseline_model(cfg).to(device).train()
        if cfg.model.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        o, t = cfg.optim, cfg.trainer
        kernels = optimizer_kernels(o.impl, self.model.parameters())
        if o.name == "adamw":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                               weight_decay=o.weight_decay, **kernels)
        else:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=o.lr, momentum=o.momentum,
                                             weight_decay=o.weight_decay, **kernels)
        self.forward = torch.compile(self.model) if t.compile else self.model
        self.autocast = autocast_for(t.precision, device)
        self.scaler = torch.amp.GradScaler(device.type) if precision_name(t.precision) == "16" else None
        self.clip, self.smoothing = t.clip_grad, t.label_smoothing
        self.classification = cfg.model.family == "vit"

    def step(self, batches: list[tuple]) -> None:
        """One optimizer step over the micro-batches (gradient accumulation)."""
        for images, targets in batches:
            with self.autocast:
                out = self.forward(images) if self.classification else self.forward(images, targets)
            if self.classification:
                loss = F.cross_entropy(out.float(), targets, label_smoothing=self.smoothing)
            else:
                loss = sum(v.float() for v in out.values())
            loss = loss / len(batches)
            (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if self.scaler is not None:  # torch's AMP recipe: unscale, clip, step (skipped on inf/NaN), update
            self.scaler.unscale_(self.optimizer)
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


# -- the run -------------------------------------------------------------------------------------------------------


def _spread(times: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times),
            "std_ms": 1e3 * (statistics.stdev(times) if len(times) > 1 else 0.0)}


class OursRun:
    """One configuration's real `Trainer`, stepping on fixed synthetic batches."""

    def __init__(self, name: str, cfg: DictConfig, layout: Layout, run_dir: Path, family: str):
        from visiondist.engine.trainer import Trainer

        self.name, self.cfg, self.layout, self.device = name, cfg, layout, layout.device
        memory = PeakMemory(self.device)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.trainer = Trainer(cfg, layout, run_dir)
        micro = self.trainer.data.train_sampler.micro_batch  # per DP rank and accumulation step
        self.batches = [synthetic_batch(cfg, family, micro, self.device, seed=i) for i in range(cfg.trainer.grad_accum)]
        pipelined = self.trainer.pipeline is not None
        self.trainer.reset_traffic()
        time_steps(self.step, max(cfg.bench.warmup, 2 if pipelined else 1), self.device)
        self.trainer.reset_traffic()
        time_steps(self.step, 1, self.device)  # one step's traffic (every step moves the same)
        self.tp_bytes = layout.tp_comm.ring_bytes() if layout.tp_comm is not None else 0.0
        self.pp_bytes = self.trainer.pipeline.p2p.bytes if pipelined else 0
        self.peak_memory_gb = memory.increase_gb()
        self.times: list[float] = []

    def step(self) -> None:
        select_attention(self.cfg.model.sdpa)  # process-wide: each configuration sets its own
        self.trainer.train_step(iter(self.batches))
        self.trainer.step += 1


def run_benchmark(cfg: DictConfig, layout: Layout, run_dir: Path) -> list[dict[str, Any]] | None:
    """Entry point of every rank of `tools/benchmark.py`. Rank 0 prints the table, appends one result per configuration
    to `<bench.results_dir>/results.jsonl` and `results.md`, and returns them."""
    from visiondist.config import variant_config
    from visiondist.engine.trainer import prepare_rank, seed_everything

    b, device = cfg.bench, layout.device
    prepare_rank(cfg, layout, run_dir)
    family = _task_family(cfg)
    configs = [("", cfg)] + [(v, variant_config(cfg, v)) for v in b.variants]
    runs = [OursRun(name, c, layout, run_dir if i == 0 else run_dir / "variants" / str(i), family)
            for i, (name, c) in enumerate(configs)]
    if device.type == "cpu" and len(runs) == 1:  # the process's peak: it is the configuration's only when alone
        runs[0].peak_memory_gb = PeakMemory.rss_gb()

    plain, peak_plain = None, None
    if b.baseline and layout.world_size == 1:
        seed_everything(cfg.trainer.seed)
        memory = PeakMemory(device)
        plain = PlainLoop(cfg, device)
        time_steps(lambda: plain.step(runs[0].batches), max(b.warmup, 1), device)
        peak_plain = memory.increase_gb()
    elif b.baseline and layout.is_main:
        log.info("baseline skipped: the plain loop runs on one device (this run has %d ranks)", layout.world_size)

    plain_times: list[float] = []
    for _ in range(b.rounds):  # interleaved, so that slow drift (clocks, other load) hits every configuration alike
        for run in runs:
            run.times += time_steps(run.step, b.steps, device)
        if plain is not None:
            select_attention(cfg.model.sdpa)
            plain_times += time_steps(lambda: plain.step(runs[0].batches), b.steps, device)
    for run in runs:
        run.trainer.settle()

    loader_rate = None
    if b.loader_batches and layout.reads_images:
        loader_rate = loader_images_per_s(runs[0].trainer.data.train_loader, b.loader_batches) * layout.dp

    if not layout.is_main:
        return None
    dtype = autocast_dtype(cfg.trainer.precision) or torch.float32
    peak = matmul_peak_tflops(device, dtype) if b.peak else None
    flops = train_flops_per_image(cfg.model, runs[0].batches[0], family)
    common = {"date": datetime.now().strftime("%Y-%m-%d"), "device": device_name(device), "torch": torch.__version__,
              "model": cfg.model.name,
              "img_size": cfg.model.img_size if family == "classification" else cfg.data.min_size,
              "layout": runs[0].trainer.layout_text, "ranks": layout.world_size, "batch": cfg.data.batch_size,
              "gflops_per_image": flops / 1e9, "peak_tflops": peak, "loader_images_per_s": loader_rate}
    plain_step = statistics.median(plain_times) if plain_times else None
    first_step = statistics.median(runs[0].times)
    results = []
    for run in runs:
        c = run.cfg
        step_s = statistics.median(run.times)
        images_per_s = cfg.data.batch_size / step_s
        achieved = flops * images_per_s / layout.world_size / 1e12  # per device
        grad_bytes = sum(p.numel() * p.element_size() for p in run.trainer.model.parameters())
        dp_bytes = 2 * (layout.dp - 1) / layout.dp * grad_bytes if layout.dp > 1 and not c.parallel.fsdp else 0.0
        results.append({
            **common,
            "variant": run.name or "-",
            "precision": str(c.trainer.precision),
            "compile": bool(c.trainer.compile),
            "optimizer": f"{c.optim.name} ({c.optim.impl})",
            "sdpa": c.model.sdpa,
            "activation_checkpointing": bool(c.parallel.activation_checkpointing),
            "channels_last": bool(c.model.channels_last),
            "steps_timed": len(run.times),
            "images_per_s": images_per_s,
            "step": _spread(run.times),
            "tflops_per_device": achieved,
            "mfu": achieved / peak if peak else None,
            "peak_memory_gb": run.peak_memory_gb,
            "memory_kind": "max allocated" if device.type == "cuda" else "peak RSS",
            "tp_bytes_per_step": run.tp_bytes,
            "pp_bytes_per_step": run.pp_bytes,
            "dp_bytes_per_step": dp_bytes,  # DDP's gradient all-reduce, ring: 2(n-1)/n of the gradients (analytic)
            "over_first": step_s / first_step,
            "baseline_images_per_s": cfg.data.batch_size / plain_step if plain_step else None,
            "baseline_step": _spread(plain_times) if plain_times else None,
            "baseline_peak_memory_gb": peak_plain,
            "ours_over_baseline": step_s / plain_step if plain_step else None,
        })
    write_results(results, Path(cfg.bench.results_dir))
    (run_dir / "benchmark.json").write_text(json.dumps(results, indent=1))
    import sys

    from rich.console import Console

    Console(width=None if sys.stdout.isatty() else 150).print(result_table(results))  # logs get the whole table
    return results


# -- reporting -----------------------------------------------------------------------------------------------------

MD_HEADER = ("| date | device | model | px | layout | variant | precision | compile | batch | img/s "
             "| step ms (median, min-max) | GFLOP/img | TFLOP/s | MFU | peak mem (GB) | baseline img/s | ours/baseline "
             "| loader img/s |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec) + suffix


def markdown_row(r: dict[str, Any]) -> str:
    s = r["step"]
    return (f"| {r['date']} | {r['device']} | {r['model']} | {r['img_size']} | {r['layout']} | {r['variant']} | "
            f"{r['precision']} | {'on' if r['compile'] else 'off'} | {r['batch']} | {r['images_per_s']:.4g} | "
            f"{s['median_ms']:.1f} ({s['min_ms']:.1f}-{s['max_ms']:.1f}) | {r['gflops_per_image']:.4g} | "
            f"{r['tflops_per_device']:.3g} | {_fmt(r['mfu'] and 100 * r['mfu'], '.1f', '%')} | "
            f"{_fmt(r['peak_memory_gb'], '.2f')} | {_fmt(r['baseline_images_per_s'], '.4g')} | "
            f"{_fmt(r['ours_over_baseline'], '.3f')} | {_fmt(r['loader_images_per_s'], '.4g')} |\n")


def write_results(results: list[dict[str, Any]], results_dir: Path) -> None:
    """Append one JSON line per configuration to results.jsonl and one row each to results.md (with its header when
    new)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / "results.jsonl", "a") as f:
        for result in results:
            f.write(json.dumps(result) + "\n")
    md = results_dir / "results.md"
    with open(md, "a") as f:
        if not md.stat().st_size:
            f.write(MD_HEADER)
        for result in results:
            f.write(markdown_row(result))


def result_table(results: list[dict[str, Any]]):
    """One row per configuration (and the plain loop), the figures shared by all of them in the caption."""
    from rich.table import Table

    first = results[0]
    caption = (f"{first['gflops_per_image']:.4g} GFLOP per image (forward + backward, counted); matmul peak "
               f"{_fmt(first['peak_tflops'], '.3g')} TFLOP/s (measured); loader alone "
               f"{_fmt(first['loader_images_per_s'], '.4g')} images/s; per step: TP {first['tp_bytes_per_step'] / 1e6:.2f}"
               f" MB, PP {first['pp_bytes_per_step'] / 1e6:.2f} MB, DP all-reduce {first['dp_bytes_per_step'] / 1e6:.2f}"
               f" MB sent per rank; peak memory: {first['memory_kind']}")
    table = Table(title=f"{first['model']} | {first['layout']} | batch {first['batch']} | {first['device']}",
                  caption=caption, show_header=True)
    for name in ("", "images/s", "step ms (median)", "min-max", "std", "/ baseline", "/ first", "TFLOP/s", "MFU",
                 "peak GB"):
        table.add_column(name, justify="left" if not name else "right")
    for r in results:
        s = r["step"]
        table.add_row("visiondist" + ("" if r["variant"] == "-" else f" {r['variant']}"), f"{r['images_per_s']:.4g}",
                      f"{s['median_ms']:.1f}", f"{s['min_ms']:.1f}-{s['max_ms']:.1f}", f"{s['std_ms']:.1f}",
                      _fmt(r["ours_over_baseline"], ".3f"), f"{r['over_first']:.3f}", f"{r['tflops_per_device']:.3g}",
                      _fmt(r["mfu"] and 100 * r["mfu"], ".1f", "%"), _fmt(r["peak_memory_gb"], ".2f"))
    base = first["baseline_step"]
    if base:
        table.add_row("plain PyTorch loop", f"{first['baseline_images_per_s']:.4g}", f"{base['median_ms']:.1f}",
                      f"{base['min_ms']:.1f}-{base['max_ms']:.1f}", f"{base['std_ms']:.1f}", "1.000", "", "", "",
                      _fmt(first["baseline_peak_memory_gb"], ".2f"))
    return table
