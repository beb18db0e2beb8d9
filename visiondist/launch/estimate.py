"""A layout written for GPUs on a machine without one. `trainer.accelerator=auto` runs on the CPU
when no GPU is visible; for one rank (the default job) that is what a laptop is for, but a layout of
several ranks (`parallel=tp4`, `parallel.dp=2`, ...) starts that many CPU processes, possibly for
hours. The launcher (`visiondist.launch.launch`, once the layout is resolved, before the run
directory or any rank) says so with the time model's estimate of a step and of the whole run on this
machine's CPU, and stops a run estimated at over an hour, naming the setting that runs it there
anyway (`trainer.accelerator=cpu`). Under torchrun / srun the ranks were started by the user:
nothing is said or refused there.

The estimate is the planner's (`visiondist.plan.time_model.step_seconds`: FLOPs over the device
rate, plus the collectives' bytes over the link) with this CPU's measured dense matmul rate
(`visiondist.utils.peaks`) shared by the node's ranks, and `CPU_LINK_GBS` between them. It covers
training steps of ViT classifiers (the planner's models); for a detector or an evaluation the line
says there is no estimate.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig

from visiondist.config import ConfigError
from visiondist.config.layout import RunLayout
from visiondist.models.registry import spec_of
from visiondist.plan.planner import hardware_from_config
from visiondist.plan.resolve import layout_memory
from visiondist.plan.time_model import Candidate, step_seconds
from visiondist.plan.world import host_memory_gb
from visiondist.utils.logs import warn_once
from visiondist.utils.peaks import matmul_tflops, peak_kind

# gloo between the processes of one machine, per rank (the time model's link on the CPU)
CPU_LINK_GBS = 2.0


# a whole run estimated longer than this on the CPU is refused unless asked for
REFUSE_OVER_S = 3600.0


# One rank's run is measured (about a second) only where it would take over a minute at this rate,
# above what ViT training reaches on a CPU (2 cores: 0.1 TFLOP/s): the default job's is not.
CPU_TFLOPS_BOUND = 1.0
MEASURED_FROM_S = 60.0


def check_gpu_layout(cfg: DictConfig, run: RunLayout, kind: Optional[str] = None) -> None:
    """A self-launched job that `trainer.accelerator=auto` put on the CPU because no GPU was found:
    for several ranks, one line saying so, with the estimated time per step and for the run, printed
    before any rank starts; refused (`ConfigError`, nothing started) when the whole run is estimated
    at over an hour. One rank (the default job, meant for the CPU) is refused alike where its run
    would take over an hour (`python tools/train.py model=vit_huge`: hours), and says nothing
    otherwise. `kind`: the entry's run kind (`visiondist.launch.run_kind`): None for
    training, "benchmark" (no whole-run figure), "eval" (no estimate)."""
    if cfg.trainer.accelerator != "auto" or run.accelerator != "cpu" or run.under_torchrun:
        return
    # the run's length, counted once (an ImageFolder's training images are listed for it)
    length = run_steps(cfg) if kind is None else (None, "")
    if run.world_size == 1 and not _long_on_one_cpu_rank(cfg, run, length[0]):
        return
    text, whole = cpu_estimate_seconds(cfg, run, kind, length=length)
    if run.world_size == 1 and (whole is None or whole <= REFUSE_OVER_S):
        return
    ranks = (
        f"{run.world_size} ranks (dp={run.dp} tp={run.tp} pp={run.pp}) as {run.world_size} "
        "processes"
        if run.world_size > 1
        else "1 rank as one process"
    )
    what = (
        f"no GPU was found, so trainer.accelerator=auto {{}} {cfg.model.name} on {ranks} on this "
        f"machine's CPU{': ' if text else ''}{text}"
    )
    if whole is not None and whole > REFUSE_OVER_S:
        raise ConfigError(
            what.format("would run")
            + "; to run it here anyway add trainer.accelerator=cpu (or run it "
            "where GPUs are visible)"
        )
    # once in a Python session that evaluates a run again and again
    warn_once(f"{what.format('runs')} (trainer.accelerator=cpu says this is meant)")


def _long_on_one_cpu_rank(cfg: DictConfig, run: RunLayout, steps: Optional[int]) -> bool:
    """Whether one rank's training run of `steps` (None: not a training run, or of unknown
    length) is worth measuring this CPU for: over `MEASURED_FROM_S` at `CPU_TFLOPS_BOUND`."""
    if not steps or spec_of(cfg.model).planner_shape is None:
        return False
    return step_seconds_on_cpu(cfg, run, CPU_TFLOPS_BOUND) * steps > MEASURED_FROM_S


def cpu_estimate(
    cfg: DictConfig, run: RunLayout, kind: Optional[str] = None, tflops: Optional[float] = None
) -> str:
    """'about 1.73 min per step, 8.03 h for the 279 steps of trainer.max_epochs=3 (...)': the time
    model on this CPU for `run`'s layout. `tflops`: this machine's dense matmul rate (default:
    measured now, about a second)."""
    return cpu_estimate_seconds(cfg, run, kind, tflops)[0]


def cpu_estimate_seconds(
    cfg: DictConfig,
    run: RunLayout,
    kind: Optional[str] = None,
    tflops: Optional[float] = None,
    length: Optional[tuple[Optional[int], str]] = None,
) -> tuple[str, Optional[float]]:
    """`cpu_estimate`'s text and the whole run's estimated seconds (None: no whole-run estimate).
    `length`: `run_steps`' answer where the caller has it."""
    if spec_of(cfg.model).planner_shape is None:
        return (
            f"no time estimate ({cfg.model.name} is a detector; the time model covers ViT "
            "classifiers)",
            None,
        )
    if kind in ("eval", "predict"):  # the time model estimates training steps
        return "", None
    machine = measured_tflops(cfg) if tflops is None else tflops
    step = step_seconds_on_cpu(cfg, run, machine / run.per_node)
    basis = (
        f"the time model at this CPU's {machine * 1e3:.3g} GFLOP/s dense matmul rate, measured "
        f"now, {f'shared by {run.per_node} ranks' if run.per_node > 1 else 'one rank'}: an estimate"
    )
    if length is None:  # a benchmark runs its own steps
        length = run_steps(cfg) if kind is None else (None, "")
    steps, limit = length
    whole = f", {duration(step * steps)} for the {steps} steps ({limit})" if steps else ""
    return f"about {duration(step)} per step{whole} ({basis})", (step * steps if steps else None)


def measured_tflops(cfg: DictConfig) -> float:
    """This machine's dense matmul rate (all of this process's threads) in the precision the step's
    matmuls run in."""
    cpu = torch.device("cpu")
    return matmul_tflops(
        cpu, peak_kind(str(cfg.trainer.precision), bool(cfg.trainer.tf32), cpu), repeats=1
    )


def step_seconds_on_cpu(cfg: DictConfig, run: RunLayout, tflops_per_rank: float) -> float:
    """The planner's seconds per optimizer step of `cfg`'s ViT under `run`, each rank computing at
    `tflops_per_rank` and sending at `CPU_LINK_GBS`."""
    candidate = Candidate.of(
        run if run.grad_accum else run.replace(grad_accum=int(cfg.trainer.grad_accum))
    )
    hardware = replace(
        hardware_from_config(
            cfg.parallel, run.world_size, 1, host_memory_gb() / run.per_node, shared_host=True
        ),
        tflops=tflops_per_rank,
        intra_node_gbs=CPU_LINK_GBS,
        inter_node_gbs=CPU_LINK_GBS,
    )
    planner_shape = spec_of(cfg.model).planner_shape
    if planner_shape is None:  # `cpu_estimate_seconds` asks first
        raise ConfigError(f"{cfg.model.name}: the time model covers ViT classifiers")
    t = cfg.trainer
    seconds = step_seconds(
        planner_shape(cfg.model),
        candidate,
        hardware,
        int(cfg.data.batch_size),
        layout_memory(cfg, run),
        str(t.precision),
    )
    return seconds["total"]


def run_steps(cfg: DictConfig) -> tuple[Optional[int], str]:
    """(optimizer steps of the whole run, which limit sets them) as the trainer counts them
    (`visiondist.engine.build.run_length`): `trainer.max_steps` where it is on, else
    `trainer.max_epochs` of the training split's images; (None, "") where an epoch's length is not
    known before the data is read."""
    # the trainer's own count; its module is a rank's (DTensor, DCP, the models: 2 s)
    from visiondist.engine.build import run_length  # noqa: PLC0415 (rank-side)

    t, d = cfg.trainer, cfg.data
    if t.max_steps > 0:  # the epoch's length does not count
        return run_length(t, 0)
    images = train_images(d) if t.max_epochs > 0 else None
    if images is not None:
        return run_length(t, images // int(d.batch_size))
    return None, ""


def train_images(d: DictConfig) -> Optional[int]:
    """Images of the training split of an ImageFolder-layout set (a built-in one: as it is
    generated); None for another format."""
    if d.format != "imagefolder":
        return None
    if d.synthetic is not None:
        from visiondist.synthetic.shapes import SHAPE_CLASSES  # noqa: PLC0415 (PIL, 20 ms)

        return int(d.synthetic.train_per_class) * len(SHAPE_CLASSES)
    # PIL comes with these two: 20-30 ms of every launch, which only this count needs
    from visiondist.data.imagefolder import IMG_EXTENSIONS  # noqa: PLC0415 (PIL, 30 ms)

    split = Path(d.root).expanduser() / d.train_split
    total = 0
    with os.scandir(split) as classes:
        for c in classes:
            if c.is_dir() and not c.name.startswith("."):
                with os.scandir(c.path) as files:
                    total += sum(
                        1 for f in files if f.name.lower().endswith(IMG_EXTENSIONS) and f.is_file()
                    )
    return total


def duration(seconds: float) -> str:
    """`41.2 s`, `12.5 min`, `3.19 h`, `2.1 days`."""
    for unit, size in (("days", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size if unit == "days" else seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"
