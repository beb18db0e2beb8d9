"""`tools/benchmark.py`: the training step's speed against the hardware and against plain PyTorch loops.

Every rank builds the real `Trainer` (model, layout, optimizer, fast-path switches) and times `Trainer.train_step` on
synthetic batches that already sit on the device, so the figure is the step's and not the loader's (under
`data.decode_on=device`, the JPEG bytes of the run's own first batches, decoded ahead as in training: nvJPEG's time
depends on the files). Steps are timed with CUDA events, back to back, as the training log times them. On one device,
each configuration (the run's, then each of `bench.variants`) also gets its own plain loops, built from that
configuration (`visiondist.bench.plain_loop`): one on timm's model of the same shape and one on visiondist's own
model, so that ours / plain splits into the harness's overhead and the model's difference. Every loop gets its own
warm-up; then `bench.rounds` rounds time `bench.steps` steps of each loop, the configurations rotated and each
configuration's loops reversed from one round to the next, so that neither side always runs first or after the
other (warm caches, clock drift); the order run is recorded.

Reported next to it: FLOPs per image counted by `torch.utils.flop_counter` on the unsharded model (forward +
backward), the achieved TFLOP/s per device, MFU against the datasheet's dense peak and against the dense matmul rate
measured in the run (both in the step's matmul precision: `visiondist.utils.peaks`), peak memory, the TP / pipeline
traffic per step from their counters, and the real train loader's images/s on its own. A ratio whose step times are
too few or too spread to mean anything is marked so (`visiondist.bench.report`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from visiondist.bench.measure import (
    device_input_work,
    decoded_batch,
    device_name,
    loader_images_per_s,
    PeakMemory,
    Stopped,
    synthetic_batch,
    time_steps,
    train_flops_per_image,
)
from visiondist.bench.report import ratio_check, result_table, step_summary, write_results
from visiondist.utils.peaks import datasheet_tflops, matmul_tflops, peak_kind
from visiondist.bench.plain_loop import PlainLoop, baseline_roles
from visiondist.utils.signals import STOP
from visiondist.models.sdpa import current_order, select_attention
from visiondist.parallel import Layout

log = logging.getLogger(__name__)


def _task_family(cfg: DictConfig) -> str:
    from visiondist.models import TASKS

    return TASKS[cfg.model.family]


# -- the run -------------------------------------------------------------------------------------------------------


def apply_switches(cfg: DictConfig, device: torch.device, attention: Optional[list[str]] = None) -> None:
    """The process-wide switches a configuration's steps run under: the attention kernel (in `attention`'s order: what
    `model.sdpa=auto` measured for the trainer; the plain loops get torch's own), and TF32 on CUDA."""
    from visiondist.train.precision import set_tf32

    select_attention(cfg.model.sdpa, attention)
    if device.type == "cuda":
        set_tf32(cfg.trainer.tf32)


class OursRun:
    """One configuration's real `Trainer`, stepping on fixed synthetic batches."""

    def __init__(self, name: str, cfg: DictConfig, layout: Layout, run_dir: Path, family: str):
        from visiondist.train.optim import describe_optimizer
        from visiondist.train.trainer import Trainer

        self.name, self.cfg, self.layout, self.device = name, cfg, layout, layout.device
        apply_switches(cfg, self.device)
        memory = PeakMemory(self.device)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.trainer = Trainer(cfg, layout, run_dir)
        self.attention = current_order()  # model.sdpa=auto on CUDA: the order the build measured
        self.optimizer_name = describe_optimizer(self.trainer.optimizer, cfg.optim.impl)
        micro = self.trainer.data.train_sampler.micro_batch  # per DP rank and accumulation step
        accum = cfg.trainer.grad_accum
        if family == "classification" and cfg.data.get("decode_on", "loader") == "device" and layout.reads_images:
            self.batches = self._own_jpegs(accum)  # nvJPEG's time depends on the files: the run's own first batches
        else:
            self.batches = [synthetic_batch(cfg, family, micro, self.device, seed=i) for i in range(accum)]
        self.plain_batches = [decoded_batch(b, self.device) for b in self.batches]  # plain loops decode in loaders
        self.feed = self.trainer.task.feed(itertools.cycle(self.batches), self.device)  # as the trainer's batches
        pipelined = self.trainer.pipeline is not None
        self.trainer.reset_traffic()
        with CompileWatch() as watch:  # compiling happens here: a graph break or a recompile-limit hit fails the row
            time_steps(self.step, max(cfg.bench.warmup, 2 if pipelined else 1), self.device)
        self.compile_faults = watch.faults
        self.trainer.reset_traffic()
        time_steps(self.step, 1, self.device)  # one step's traffic (every step moves the same)
        self.tp_bytes = layout.tp_comm.ring_bytes() if layout.tp_comm is not None else 0.0
        self.pp_bytes = self.trainer.pipeline.p2p.bytes if pipelined else 0
        self.peak_memory_gb = memory.increase_gb()
        self.idle()

    def _own_jpegs(self, count: int) -> list[tuple]:
        """The train loader's first `count` batches (data.decode_on=device: the JPEG bytes of the run's own images and
        their crops and augmentation rows), the labels on the device."""
        loader = iter(self.trainer.data.train_loader)
        batches = []
        for _ in range(count):
            images, labels, *rows = next(loader)
            batches.append((images, labels.to(self.device), *rows))
        return batches

    def step(self) -> None:
        self.trainer.train_step(self.feed)
        self.trainer.step += 1

    def close(self) -> None:
        if hasattr(self.feed, "close"):  # data.decode_on=device: its decoding thread
            self.feed.close()

    def idle(self) -> None:
        """Free the gradients while other loops run (the next step starts by dropping them anyway)."""
        self.trainer.optimizer.zero_grad(set_to_none=True)


class CompileWatch:
    """What torch.compile did while the block ran, read from dynamo's counters: graph breaks and recompile-limit hits
    (code that then runs eager), and with `timed`, any graph compiled at all (a timed step that compiles is not a
    step's time). `faults` names each, with torch's reason."""

    def __init__(self, timed: bool = False):
        self.timed, self.faults = timed, []

    def __enter__(self) -> "CompileWatch":
        from visiondist.train.compiled import compile_counts

        self.graphs, self.reasons = compile_counts()
        return self

    def __exit__(self, *exc) -> None:
        from visiondist.train.compiled import compile_counts

        graphs, reasons = compile_counts()
        for reason, n in reasons.items():
            if n > self.reasons.get(reason, 0):
                self.faults.append(f"{n - self.reasons.get(reason, 0)}x {reason}")
        if self.timed and graphs > self.graphs:
            self.faults.append(f"{graphs - self.graphs} graph(s) compiled while timed (a recompilation)")


class Timed:
    """One loop of one configuration as the rounds see it: its label ("<configuration>:<loop>"), its steps, the
    seconds they took and what went wrong compiling it (`CompileWatch`), warm-up included."""

    def __init__(self, label: str, cfg: DictConfig, step: Callable[[], Any], idle: Callable[[], Any] = lambda: None,
                 attention: Optional[list[str]] = None, faults: Optional[list[str]] = None):
        self.label, self.cfg, self.step, self.idle, self.attention = label, cfg, step, idle, attention
        self.times: list[float] = []
        self.faults = list(faults or [])


def plain_loops(cfg: DictConfig, batches: list[tuple], device: torch.device, switches) -> dict[str, PlainLoop]:
    """This configuration's plain loops (`baseline_roles`), each warmed up on its own, with its peak memory."""
    loops = {}
    for role in baseline_roles(cfg):
        apply_switches(cfg, device)
        memory = PeakMemory(device)
        loop = PlainLoop(cfg, role, device, switches)
        with CompileWatch() as watch:
            time_steps(lambda: loop.step(batches), max(cfg.bench.warmup, 1), device)
        loop.compile_faults = watch.faults
        loop.peak_memory_gb = memory.increase_gb()
        loops[role] = loop
    return loops


def round_order(groups: list[list[Timed]], index: int) -> list[Timed]:
    """The loops of round `index`: the configurations rotated by `index`; each one's loops (ours, the plain loop on
    our model, the plain loop on timm's) in that order in even rounds and reversed in odd ones. Ours and the plain loop
    on the same model are always neighbours; over two rounds each runs first and last."""
    n = len(groups)
    rotated = [groups[(i + index) % n] for i in range(n)]
    return [loop for group in rotated for loop in (group if index % 2 == 0 else group[::-1])]


def time_rounds(groups: list[list[Timed]], rounds: int, steps: int, device: torch.device,
                stop: Optional[Callable[[], bool]] = None, say: bool = False) -> list[list[str]]:
    """Time every loop `steps` steps per round; returns the labels in the order they ran, round by round. `say`: a
    line as each round ends (the table comes at the end: into a pipe or a log, these say how far it is)."""
    order, loops, started = [], sum(len(g) for g in groups), time.perf_counter()
    for index in range(rounds):
        ran = []
        for loop in round_order(groups, index):
            apply_switches(loop.cfg, device, loop.attention)
            with CompileWatch(timed=True) as watch:
                loop.times += time_steps(loop.step, steps, device, stop)
            loop.faults += watch.faults
            loop.idle()
            ran.append(loop.label)
        order.append(ran)
        if say:
            log.info("benchmark: round %d of %d timed (%d loop%s, %.0f s)", index + 1, rounds, loops,
                     "s" if loops != 1 else "", time.perf_counter() - started)
    return order


def _stop_check(layout: Layout, runs: list) -> Callable[[], bool]:
    """Whether to stop after the step just timed. One rank: its own stop signal. Several: the step flags every rank
    all-reduces (`Trainer.stop_requested`, read a step late), so that every rank stops after the same step."""
    if layout.world_size == 1:
        return lambda: STOP.received is not None
    return lambda: any(run.trainer.stop_requested for run in runs)


def _announce(b: DictConfig) -> None:
    """What the benchmark does before its first timed step (the table comes at the end)."""
    log.info("benchmark: building %d configuration%s and warming up each loop (%d step%s), then %d rounds of %d "
             "timed steps (bench.warmup, bench.rounds, bench.steps)", 1 + len(b.variants),
             "s" if b.variants else "", b.warmup, "s" if b.warmup != 1 else "", b.rounds, b.steps)


def _timed_loops(runs: list, plains: list[dict]) -> list[list[Timed]]:
    """Each configuration's loops as the rounds time them: ours, then its plain loops."""
    return [[Timed(f"{i}:ours", run.cfg, run.step, run.idle, run.attention, run.compile_faults)]
            + [Timed(f"{i}:plain_{role}", run.cfg, lambda loop=loop, run=run: loop.step(run.plain_batches),
                     faults=loop.compile_faults) for role, loop in plains[i].items()] for i, run in enumerate(runs)]


def run_benchmark(cfg: DictConfig, layout: Layout, run_dir: Path) -> list[dict[str, Any]] | dict | None:
    """Entry point of every rank of `tools/benchmark.py`. Rank 0 prints the table, appends one result per configuration
    to `results.jsonl` and `results.md` in `bench.results_dir` (default: the run dir), and returns them. A stop signal
    ends it after the step in flight with nothing recorded (the launcher then exits 128 + the signal)."""
    from visiondist.config import variant_config
    from visiondist.plan import with_switches
    from visiondist.train.build import prepare_rank

    b, device = cfg.bench, layout.device
    prepare_rank(cfg, layout, run_dir, "benchmark.log")
    if layout.is_main:
        _announce(b)
    family = _task_family(cfg)
    configs = [("", cfg)] + [(v if isinstance(v, str) else " ".join(map(str, v)), variant_config(cfg, v))
                             for v in b.variants]
    runs = [OursRun(name, c, dataclasses.replace(layout, run=with_switches(layout.run, c)),  # same ranks, c's switches
                    run_dir if i == 0 else run_dir / "variants" / str(i), family) for i, (name, c) in enumerate(configs)]
    baselines = b.baseline and layout.world_size == 1
    if b.baseline and not baselines and layout.is_main:
        log.info("baselines skipped: the plain loops run on one device (this run has %d ranks)", layout.world_size)
    plains = [plain_loops(run.cfg, run.plain_batches, device, run.layout.run) if baselines else {} for run in runs]
    groups = _timed_loops(runs, plains)
    try:
        order = time_rounds(groups, b.rounds, b.steps, device, _stop_check(layout, runs), say=layout.is_main)
    except Stopped:
        signal_name = STOP.received or "SIGTERM"  # another rank's signal reaches this one through the step flags
        # nothing recorded: the launcher's last line says so (`visiondist.launch.stop`)
        return {"stopped at step": sum(len(t.times) for g in groups for t in g), "stopped by": signal_name,
                "run dir": str(run_dir)}
    finally:
        for run in runs:
            run.close()
    for run in runs:
        run.trainer.settle()

    loader_rates = [None] * len(runs)  # each configuration's own loader (a variant may change the input path)
    if b.loader_batches and layout.reads_images:
        loader_rates = [loader_images_per_s(run.trainer.data.train_loader, b.loader_batches) * layout.dp
                        for run in runs]
    if not layout.is_main:
        return None
    results = collect_results(cfg, layout, runs, plains, groups, order, family, loader_rates)
    results_dir = Path(cfg.bench.results_dir) if cfg.bench.results_dir else run_dir
    write_results(results, results_dir)
    (run_dir / "benchmark.json").write_text(json.dumps(results, indent=1))
    import sys

    from rich.console import Console

    from visiondist.observe.console import shown_path

    Console(width=None if sys.stdout.isatty() else 240).print(result_table(results))  # logs get the whole table
    print(f"results: {shown_path(results_dir / 'results.jsonl')}, {shown_path(results_dir / 'results.md')}; run dir: "
          f"{shown_path(run_dir)} (benchmark.json, benchmark.log)", flush=True)
    faulted = [f"{_row_name(r)}: {'; '.join(r['compile_faults'])}" for r in results if r["compile_faults"]]
    if faulted:  # recorded (the rows say so too), but the run failed: those figures time eager code or compiling
        raise CompileFaults(f"{len(faulted)} of {len(results)} rows compiled with faults, their rates are not the "
                            f"compiled step's: {' | '.join(faulted)}")
    return results


class CompileFaults(RuntimeError):
    """A benchmark row whose compiled loops broke their graphs, hit the recompile limit or compiled while timed."""


def _row_name(r: dict[str, Any]) -> str:
    return f"{r['model']} {'' if r['variant'] == '-' else r['variant']}".strip()


run_benchmark.run_kind = "benchmark"  # type: ignore[attr-defined]  # its default run dir: <output dir>/benchmark/...


# -- results -------------------------------------------------------------------------------------------------------


def _ratios(ours: Timed, plain: dict[str, Timed], first: Timed | None) -> dict[str, Any]:
    """The row's ratios of median step times, each with its uncertainty and, when it means nothing, why."""
    reference, same = plain.get("reference"), plain.get("same_model")
    pairs = {"ours_over_plain": (ours, reference or same), "harness_overhead": (ours, same),
             "model_difference": (same, reference if same else None), "over_first": (ours, first)}
    values, uncertainty, warnings = {}, {}, {}
    for key, (a, b) in pairs.items():
        if a is None or b is None:
            values[key] = 1.0 if key == "over_first" else None
            continue
        values[key] = statistics.median(a.times) / statistics.median(b.times)
        uncertainty[key], why = ratio_check(a.times, b.times)
        if why:
            warnings[key] = why
    return {**values, "ratio_uncertainty": uncertainty, "ratio_warnings": warnings, "ratio_reliable": not warnings}


def _plain_summary(loop: PlainLoop, timed: Timed, built_from: str, batch: int) -> dict[str, Any]:
    return {"model": loop.model_name, "built_from": built_from, "compile_scope": loop.compile_scope,
            "compile_faults": timed.faults,
            "optimizer": loop.optimizer_name, "steps_timed": len(timed.times), "step": step_summary(timed.times),
            "images_per_s": batch / statistics.median(timed.times), "peak_memory_gb": loop.peak_memory_gb}


def collect_results(cfg: DictConfig, layout: Layout, runs: list[OursRun], plains: list[dict[str, PlainLoop]],
                    groups: list[list[Timed]], order: list[list[str]], family: str,
                    loader_rates: list[float | None]) -> list[dict[str, Any]]:
    """One result per configuration: its step against its own plain loops, the hardware's peaks and the rest."""
    device, batch = layout.device, cfg.data.batch_size
    name = device_name(device)
    kinds = [peak_kind(run.cfg.trainer.precision, run.cfg.trainer.tf32, device) for run in runs]
    measured = {kind: matmul_tflops(device, kind) for kind in sorted(set(kinds))} if cfg.bench.peak else {}
    flops: dict[str, float] = {}
    for run in runs:  # a variant may change the model's shape
        key = OmegaConf.to_yaml(run.cfg.model)
        flops[key] = flops.get(key) or train_flops_per_image(run.cfg.model, run.batches[0], family)
    cpu = device.type == "cpu"
    common = {"date": datetime.now().strftime("%Y-%m-%d"), "device": name, "torch": torch.__version__,
              "model": cfg.model.name,
              "img_size": cfg.model.img_size if family == "classification" or cfg.model.get("family") == "detr"
              else cfg.data.min_size,
              "layout": runs[0].trainer.layout_text, "ranks": layout.world_size, "batch": batch,
              "configurations": [run.name or "-" for run in runs], "order": order,
              "memory_kind": "peak RSS of the whole process (every loop)" if cpu else "max allocated (each loop)"}
    results = []
    for i, (run, kind) in enumerate(zip(runs, kinds)):
        c, ours = run.cfg, groups[i][0]
        images_per_s = batch / statistics.median(ours.times)
        gflops = flops[OmegaConf.to_yaml(c.model)] / 1e9
        achieved = gflops * images_per_s / layout.world_size / 1e3  # TFLOP/s per device
        datasheet = datasheet_tflops(name, kind) if device.type == "cuda" else None
        grad_bytes = sum(p.numel() * p.element_size() for p in run.trainer.model.parameters())
        switches = run.layout.run
        dp_bytes = 2 * (layout.dp - 1) / layout.dp * grad_bytes if layout.dp > 1 and not switches.fsdp else 0.0
        timed_plain = dict(zip(plains[i], groups[i][1:]))
        results.append({
            **common, "variant": run.name or "-", "precision": str(c.trainer.precision),
            # input work the step does on the device (timed in ours and in the plain loops, which get decoded images)
            "device_input": device_input_work(c.data) if family == "classification" else [],
            "compile": run.layout.run.compile, "compile_scope": _compile_scope(run), "optimizer": run.optimizer_name,
            # graph breaks, recompile-limit hits, compiling while timed, in ours or its plain loops: the row failed
            "compile_faults": [f"{t.label.split(':')[1]}: {f}" for t in groups[i] for f in t.faults],
            "sdpa": c.model.sdpa, "attention_order": run.attention, "fp8": c.trainer.fp8,
            "activation_checkpointing": switches.activation_checkpointing,
            "channels_last": bool(c.model.channels_last), "steps_timed": len(ours.times),
            "images_per_s": images_per_s, "step": step_summary(ours.times), "gflops_per_image": gflops,
            # whether the input path keeps up: the real loader's images/s over what this step consumes
            "loader_images_per_s": loader_rates[i],
            "loader_over_step": loader_rates[i] / images_per_s if loader_rates[i] else None,
            **_matcher_share(run.trainer.model, batch / images_per_s),
            "tflops_per_device": achieved, "peak_kind": kind, "peak_tflops_datasheet": datasheet,
            "mfu_datasheet": achieved / datasheet if datasheet else None,
            "peak_tflops_matmul": measured.get(kind), "mfu_matmul": achieved / measured[kind] if measured else None,
            "peak_memory_gb": PeakMemory.rss_gb() if cpu else run.peak_memory_gb,
            "tp_bytes_per_step": run.tp_bytes, "pp_bytes_per_step": run.pp_bytes,
            "dp_bytes_per_step": dp_bytes,  # DDP's gradient all-reduce, ring: 2(n-1)/n of the gradients (analytic)
            **{f"plain_{role}": (_plain_summary(plains[i][role], timed_plain[role], run.name or "-", batch)
                                 if role in plains[i] else None) for role in ("reference", "same_model")},
            **_ratios(ours, timed_plain, groups[0][0] if i else None),
        })
    return results


def _matcher_share(model: torch.nn.Module, step_s: float) -> dict[str, Any]:
    """A DETR-class detector's Hungarian matching per step (the criterion's host time: scipy's solving, and the wait
    for the cost matrices, which on a GPU holds the forward queued before them) beside the step's time."""
    criterion = next((m.criterion for m in model.modules() if getattr(m, "criterion", None) is not None), None)
    if criterion is None or not criterion.calls:
        return {}
    solve_ms = 1e3 * criterion.host_seconds["solve"] / criterion.calls
    wait_ms = 1e3 * criterion.host_seconds["wait"] / criterion.calls
    return {"matcher_solve_ms": solve_ms, "matcher_wait_ms": wait_ms,
            "matcher_solve_share": solve_ms / (1e3 * step_s) if step_s else None}


def _compile_scope(run: OursRun) -> str:
    """What `trainer.compile` compiled: the whole model (replayed as CUDA graphs or not), or each transformer block
    (on this rank)."""
    from visiondist.parallel import transformer_blocks

    switches = run.layout.run
    if not switches.compile:
        return "none"
    if switches.compile_scope == "model":
        return "whole model" + (", CUDA graphs" if switches.cuda_graphs else "")
    return f"per block ({len(transformer_blocks(run.trainer.model))} blocks)"
