"""`tools/benchmark.py`: the training step's speed against the hardware and against plain PyTorch
loops.

Every rank builds the training loop's parts (model, layout, optimizer, fast-path switches) and times
its optimizer step (`visiondist.engine.step.OptimizerStep`, `loops.OursRun`) on synthetic batches
that already sit on the device, so the figure is the step's and not the loader's (under
`data.decode_on=device`, the JPEG bytes of the run's own first batches, decoded ahead as in
training: nvJPEG's time depends on the files). Steps are timed with CUDA events, back to back, as
the training log times them. On one device, each configuration (the run's, then each of
`bench.variants`) also gets its own plain loops, built from that configuration
(`visiondist.bench.plain_loop`): one on timm's model of the same shape and one on visiondist's own
model, so that ours / plain splits into the harness's overhead and the model's difference. Every
loop gets its own warm-up; then `bench.rounds` rounds time `bench.steps` steps of each loop, the
configurations rotated and each configuration's loops reversed from one round to the next, so that
neither side always runs first or after the other (warm caches, clock drift); the order run is
recorded.

Reported next to it: FLOPs per image counted by `torch.utils.flop_counter` on the unsharded model
(forward + backward), the achieved TFLOP/s per device, MFU against the datasheet's dense peak and
against the dense matmul rate measured in the run (both in the step's matmul precision:
`visiondist.utils.peaks`), peak memory, the TP / pipeline traffic per step from their counters, and
the real train loader's images/s on its own. A ratio whose step times are too few or too spread to
mean anything is marked so (`visiondist.bench.report`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig
from rich.console import Console

from visiondist.bench.loops import CompileWatch, OursRun, Timed, apply_switches, plain_loops
from visiondist.bench.measure import Stopped, loader_images_per_s, time_steps
from visiondist.bench.plain_loop import PlainLoop
from visiondist.bench.report import result_table, write_results
from visiondist.bench.results import collect_results
from visiondist.config import variant_config
from visiondist.engine.build import prepare_rank, run_of
from visiondist.models import TASKS
from visiondist.observe.console import shown_path
from visiondist.parallel import Layout
from visiondist.plan import with_switches
from visiondist.utils.signals import STOP

log = logging.getLogger(__name__)


# what a benchmark rank imports once started, which the fork server of CPU ranks imports once for
# all of them (visiondist.launch.spawn): the loaders' augmentations (albumentations, about 0.5 s a
# rank)
RANK_IMPORTS = ("visiondist.data.transforms",)


def round_order(groups: list[list[Timed]], index: int) -> list[Timed]:
    """The loops of round `index`: the configurations rotated by `index`; each one's loops (ours,
    the plain loop on our model, the plain loop on timm's) in that order in even rounds and reversed
    in odd ones. Ours and the plain loop on the same model are always neighbours; over two rounds
    each runs first and last."""
    n = len(groups)
    rotated = [groups[(i + index) % n] for i in range(n)]
    return [loop for group in rotated for loop in (group if index % 2 == 0 else group[::-1])]


def time_rounds(
    groups: list[list[Timed]],
    rounds: int,
    steps: int,
    device: torch.device,
    stop: Optional[Callable[[], bool]] = None,
    say: bool = False,
) -> list[list[str]]:
    """Time every loop `steps` steps per round; returns the labels in the order they ran, round by
    round. `say`: a line as each round ends (the table comes at the end: into a pipe or a log, these
    say how far it is)."""
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
            log.info(
                "benchmark: round %d of %d timed (%d loop%s, %.0f s)",
                index + 1,
                rounds,
                loops,
                "s" if loops != 1 else "",
                time.perf_counter() - started,
            )
    return order


def _stop_check(layout: Layout, runs: list) -> Callable[[], bool]:
    """Whether to stop after the step just timed. One rank: its own stop signal. Several: the step
    flags every rank all-reduces (the loop state's `stop_requested`, read a step late), so that
    every rank stops after the same step."""
    if layout.world_size == 1:
        return lambda: STOP.received is not None
    return lambda: any(run.state.stop_requested for run in runs)


def _announce(b: DictConfig) -> None:
    """What the benchmark does before its first timed step (the table comes at the end)."""
    log.info(
        "benchmark: building %d configuration%s and warming up each loop (%d step%s), then %d "
        "rounds of %d timed steps (bench.warmup, bench.rounds, bench.steps)",
        1 + len(b.variants),
        "s" if b.variants else "",
        b.warmup,
        "s" if b.warmup != 1 else "",
        b.rounds,
        b.steps,
    )


def _timed_loops(runs: list[OursRun], plains: list[dict[str, PlainLoop]]) -> list[list[Timed]]:
    """Each configuration's loops as the rounds time them: ours, then its plain loops."""
    return [
        [Timed(f"{i}:ours", run.cfg, run.step, run.idle, run.attention, run.compile_faults)]
        + [
            Timed(f"{i}:plain_{role}", run.cfg, _plain_step(loop, run), faults=loop.compile_faults)
            for role, loop in plains[i].items()
        ]
        for i, run in enumerate(runs)
    ]


def _plain_step(loop: PlainLoop, run: OursRun) -> Callable[[], None]:
    """One step of a plain loop on its configuration's batches."""
    return lambda: loop.step(run.plain_batches)


def run_benchmark(
    cfg: DictConfig, layout: Layout, run_dir: Path
) -> list[dict[str, Any]] | dict | None:
    """Time the training step beside plain PyTorch loops: tools/benchmark.py's entry point.

    Entry point of every rank of `tools/benchmark.py`. Rank 0 prints the table, appends one
    result per configuration to `results.jsonl` and `results.md` in `bench.results_dir` (default:
    the run dir), and returns them. A stop signal ends it after the step in flight with nothing
    recorded (the launcher then exits 128 + the signal).

    Args:
        cfg: the benchmark's resolved config: the run's, with `bench.*` (variants, rounds, steps,
            warm-up, baselines).
        layout: this rank's place in the device mesh, carrying the resolved `RunLayout`.
        run_dir: the benchmark's run directory (benchmark.json, benchmark.log).

    Returns:
        On rank 0, one result row per configuration; on the other ranks None; after a stop signal,
        where it stopped (`"stopped at step"`, `"stopped by"`, `"run dir"`).
    """
    b, device = cfg.bench, layout.device
    prepare_rank(cfg, layout, run_dir, "benchmark.log")
    if layout.is_main:
        _announce(b)
    family = TASKS[cfg.model.family]
    configs = [("", cfg)] + [
        (v if isinstance(v, str) else " ".join(map(str, v)), variant_config(cfg, v))
        for v in b.variants
    ]
    # c's switches
    runs = [
        OursRun(name, c, dataclasses.replace(layout, run=with_switches(run_of(layout), c)), family)
        for name, c in configs
    ]
    baselines = b.baseline and layout.world_size == 1
    if b.baseline and not baselines and layout.is_main:
        log.info(
            "baselines skipped: the plain loops run on one device (this run has %d ranks)",
            layout.world_size,
        )
    plains = [
        plain_loops(run.cfg, run.plain_batches, device, run.layout.run) if baselines else {}
        for run in runs
    ]
    groups = _timed_loops(runs, plains)
    try:
        order = time_rounds(
            groups, b.rounds, b.steps, device, _stop_check(layout, runs), say=layout.is_main
        )
    except Stopped:
        # another rank's signal reaches this one through the step flags
        signal_name = STOP.received or "SIGTERM"
        # nothing recorded: the launcher's last line says so (`visiondist.launch.stop`)
        return {
            "stopped at step": sum(len(t.times) for g in groups for t in g),
            "stopped by": signal_name,
            "run dir": str(run_dir),
        }
    finally:
        for run in runs:
            run.close()
    for run in runs:
        run.optimizer_step.settle()

    # each configuration's own loader (a variant may change the input path)
    loader_rates: list[float | None] = [None] * len(runs)
    if b.loader_batches and layout.reads_images:
        loader_rates = [
            loader_images_per_s(run.parts.data.train_loader, b.loader_batches) * layout.dp
            for run in runs
        ]
    if not layout.is_main:
        return None
    results = collect_results(cfg, layout, runs, plains, groups, order, family, loader_rates)
    results_dir = Path(cfg.bench.results_dir) if cfg.bench.results_dir else run_dir
    write_results(results, results_dir)
    (run_dir / "benchmark.json").write_text(json.dumps(results, indent=1))
    # logs get the whole table
    Console(width=None if sys.stdout.isatty() else 240).print(result_table(results))
    print(
        f"results: {shown_path(results_dir / 'results.jsonl')}, "
        f"{shown_path(results_dir / 'results.md')}; run dir: {shown_path(run_dir)} "
        "(benchmark.json, benchmark.log)",
        flush=True,
    )
    faulted = [
        f"{_row_name(r)}: {'; '.join(r['compile_faults'])}" for r in results if r["compile_faults"]
    ]
    # recorded (the rows say so too), but the run failed: those figures time eager code or compiling
    if faulted:
        raise CompileFaults(
            f"{len(faulted)} of {len(results)} rows compiled with faults, their rates are not the "
            f"compiled step's: {' | '.join(faulted)}"
        )
    return results


class CompileFaults(RuntimeError):
    """A benchmark row whose compiled loops broke their graphs, hit the recompile limit or compiled
    while timed."""


def _row_name(r: dict[str, Any]) -> str:
    return f"{r['model']} {'' if r['variant'] == '-' else r['variant']}".strip()


run_benchmark.run_kind = "benchmark"  # type: ignore[attr-defined]  # its default run dir: <output dir>/benchmark/...
