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
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig

from visiondist.bench.measure import (
    PeakMemory,
    Stopped,
    decoded_batch,
    loader_images_per_s,
    synthetic_batch,
    time_steps,
)
from visiondist.bench.plain_loop import PlainLoop, baseline_roles
from visiondist.bench.report import result_table, write_results
from visiondist.bench.results import collect_results
from visiondist.models.sdpa import current_order, select_attention
from visiondist.parallel import Layout
from visiondist.utils.signals import STOP

log = logging.getLogger(__name__)


# what a benchmark rank imports once started, which the fork server of CPU ranks imports once for all of them
# (visiondist.launch.spawn): the loaders' augmentations (albumentations, about 0.5 s a rank)
RANK_IMPORTS = ("visiondist.data.transforms",)


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
        self.peak_memory_gb, self.peak_reserved_gb = memory.increase_gb(), memory.reserved_gb()
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
