"""The job of tools/plan.py: every layout of a model on N devices planned (memory by component,
step time, fit), the choice `parallel=auto` makes, a layout named by hand checked as tools/train.py
checks it, and `verify=` dry runs against the plan (`visiondist.verify.dryrun`).

The dry run (torch and the models, about 5 s) is imported when `verify=` asks for it."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf
from rich.console import Console

from visiondist.cli import Command, config_text, load_config
from visiondist.config import ConfigError
from visiondist.models.registry import spec_of
from visiondist.plan import cuda_device_count, plan_for, planning_world, resolve_on
from visiondist.plan.fit import as_run, devices_text
from visiondist.plan.resolve import host_budget, layout_memory, memory_budget, named_layout
from visiondist.plan.world import device_rate, devices_named
from visiondist.verify.report import TOLERANCE, report_table

# data.num_classes when it is unset and there is no data to count (the head's size)
DEFAULT_CLASSES = 1000


def plan_job(cmd: Command, configs: Path) -> int:
    """tools/plan.py's job; its exit code (1: nothing fits, the named layout does not, or a dry
    run is off the plan)."""
    verify = cmd.args.get("verify")
    if verify not in (None, "chosen", "all"):
        raise ConfigError(
            f"verify={verify}: use verify=chosen (the chosen layout) or verify=all (every layout "
            "that fits)"
        )
    cfg = load_config(configs, cmd.overrides + cmd.search, inputs=None)  # a plan reads no data
    if cmd.show:
        print(config_text(cfg, cmd.package))
        return 0
    if OmegaConf.is_missing(cfg.data, "num_classes"):
        print(
            "data.num_classes is unset and no class folders were counted (a plan reads no data): "
            "planned with "
            f"{DEFAULT_CLASSES} classes (set data.num_classes for another head)",
            file=sys.stderr,
        )
        cfg.data.num_classes = cfg.model.num_classes = DEFAULT_CLASSES
    devices, nodes = planning_world(cfg, cuda_device_count())
    accelerator = "cuda" if cfg.trainer.accelerator != "cpu" and cuda_device_count() else "cpu"
    memory, source = memory_budget(cfg, accelerator, devices // nodes)
    console = Console(width=max(120, Console().width))
    # parallel=tp4, parallel.tp=4 on auto, ...
    named = not cfg.parallel.auto or named_layout(cfg.parallel)
    # what the world cannot run at all is refused before any table, as tools/train.py refuses it
    if named:
        resolve_on(cfg, devices, nodes, fit_named=False)
    if spec_of(cfg.model).planner_shape is None:  # a detector: DDP on every device
        console.print(
            f"{cfg.model.name} is a detector: parallel=auto runs it data parallel on all "
            f"{devices} devices (the memory planner lays out ViT classifiers)",
            soft_wrap=True,
        )
        console.print(f"planned for: {inputs_line(cfg)}", soft_wrap=True)
        ddp = None if named else ({"dp": devices}, None)
        return 0 if verify is None or dry_run(cfg, devices, nodes, "DDP", ddp, console) else 1
    try:
        result = plan_for(cfg, devices, nodes, memory, accelerator)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    _print_plan(cfg, result, (devices, nodes, accelerator), (memory, source), console)
    if result.choice is None:
        console.print(f"[bold red]nothing fits[/bold red]: {result.reason}")
        return 1
    c = result.choice.candidate
    console.print(
        f"parallel=auto would choose [bold]{c.name}[/bold]: {result.reason}", soft_wrap=True
    )
    console.print(f"the same layout by hand: {c.settings()}", soft_wrap=True)
    if named and not _named_fits(cfg, devices, nodes, memory, console):
        return 1
    if verify is None:
        return 0
    return 0 if _verify(cfg, result, verify, named, (devices, nodes, memory), console) else 1


def _print_plan(cfg, result, world: tuple, budget: tuple, console) -> None:
    """The plan's table of every layout on `world` (devices, nodes, accelerator) within `budget`
    (GB a device, its source), and what it was planned for: inputs, rate, host memory."""
    devices, nodes, accelerator = world
    memory, source = budget
    on = (
        f"{devices} {'GPU' if accelerator == 'cuda' else 'device'}s ({nodes} "
        f"node{'s' if nodes > 1 else ''} of {devices // nodes}), {memory:.3g} GB each ({source})"
    )
    console.print(
        result.table(
            f"{cfg.model.name} ({result.layer_state / 1e9:.3g} GB of training state per block): "
            + on
        )
    )
    console.print(f"planned for: {inputs_line(cfg)}", soft_wrap=True)
    if accelerator == "cuda" or devices_named(cfg.parallel):
        rate, source = device_rate(cfg.parallel)
        console.print(f"step times at {rate:g} TFLOP/s a device ({source})", soft_wrap=True)
    asked_cpu = cfg.trainer.accelerator == "cpu"
    if accelerator == "cpu" and not asked_cpu and not devices_named(cfg.parallel):
        console.print(
            "[bold yellow]no GPU on this machine[/bold yellow]: planned for its CPU memory "
            f"({memory:.3g} GB a rank); to plan for GPUs elsewhere name the board, e.g. "
            "parallel.gpu=h100 (or a100-40gb, l40s, ...; or parallel.device_memory_gb=80 "
            "parallel.device_tflops=400)",
            soft_wrap=True,
        )
    host, host_source = host_budget(cfg)
    console.print(
        f"host memory for offloaded state: {host:.4g} GB per node ({host_source})", soft_wrap=True
    )


def _verify(cfg, result, verify: str, named: bool, world: tuple, console) -> bool:
    """Dry-run what `verify` asks (the chosen layout, the named one, or every layout that fits)
    on `world` (devices, nodes, GB a device); True when each is within the plan's bounds."""
    devices, nodes, memory = world
    c = result.choice.candidate
    layouts: list[tuple[str, Optional[tuple[list[str], int]]]]
    if verify == "all":
        layouts = [
            (r.candidate.name, (r.candidate.overrides(), r.candidate.accum))
            for r in result.rows
            if r.fits
        ]
    elif not named:
        layouts = [(c.name, (c.overrides(), c.accum))]
    else:
        layouts = [("the named layout", None)]
    # each, failed or not
    checked = [dry_run(cfg, devices, nodes, name, o, console, memory) for name, o in layouts]
    if len(checked) > 1:
        console.print(f"{sum(checked)} of {len(checked)} layouts within the plan's bounds")
    return all(checked)


def _named_fits(cfg, devices: int, nodes: int, memory: float, console) -> bool:
    """Print what the named layout plans and how it runs against the budget (tools/train.py decides
    the same before any rank starts); False where it cannot run (refused, nothing fits) or runs over
    the budget (parallel.fit=off)."""
    try:
        run = resolve_on(cfg, devices, nodes)
    except ConfigError as exc:
        console.print(f"[bold red]error[/bold red]: {exc}", soft_wrap=True)
        return False
    where = run.describe(on=devices_text(run, memory))
    if run.fitted:
        console.print(f"{run.fitted} (as tools/train.py decides)", soft_wrap=True)
        console.print(f"it runs as [bold]{where}[/bold]", soft_wrap=True)
        return not run.fitted.startswith("parallel.fit=off")
    need = layout_memory(cfg, run).device
    budget = cfg.parallel.headroom * memory
    unchecked = not devices_named(cfg.parallel) and run.accelerator == "cpu"
    fits = need <= budget * 1e9
    verdict = (
        f"within the {budget:.3g} GB budget"
        if fits
        else f"[bold red]over[/bold red] the {budget:.3g} GB budget"
    )
    console.print(
        f"you named [bold]{where}[/bold]: {need / 1e9:.3g} GB per device, {verdict}"
        + (
            " (on the CPU tools/train.py runs a named layout as named: it is fitted to "
            "parallel.device_memory_gb where that is given)"
            if unchecked
            else ""
        ),
        soft_wrap=True,
    )
    return fits


def inputs_line(cfg) -> str:
    """What drives the choice besides the model: the data set and its image size, the global batch,
    the precision, the optimizer."""
    t = cfg.trainer
    batch = f"global batch {cfg.data.batch_size}" + (
        f" x {t.grad_accum} accumulation" if t.grad_accum > 1 else ""
    )
    return (
        f"data={cfg.data.name} ({cfg.model.img_size} px images), {batch}, "
        f"trainer.precision={t.precision}, optim={cfg.optim.name}"
        + (", EMA" if t.ema_decay > 0 else "")
    )


def dry_run(cfg, devices: int, nodes: int, name: str, chosen, console, memory: float = 0.0) -> bool:
    """Dry-run one layout (`chosen`: its parallel.* overrides and accumulation, or None: the named
    layout); print its table and verdict; True when every figure is within the plan's bounds."""
    # torch and the models (about 5 s): not for --help or a plan
    from visiondist.verify.dryrun import (  # noqa: PLC0415 (a job's)
        DryRunError,
        chosen_ranks,
    )
    from visiondist.verify.dryrun import dry_run as run_ranks  # noqa: PLC0415 (a job's)

    start = time.perf_counter()
    overrides = None
    if chosen is not None:
        overrides, accum = chosen
        if accum is not None:
            cfg = OmegaConf.merge(cfg, {"trainer": {"grad_accum": accum}})
    run = resolve_on(cfg, devices, nodes, overrides)
    ranks = chosen_ranks(run)
    where = run.describe(on=devices_text(run, memory)) if memory else run.describe()
    console.print(
        f"\n[bold]dry run[/bold] of {name} ({where}): ranks {', '.join(map(str, ranks))} built "
        "on a fake process group on this machine's CPU, one step each",
        soft_wrap=True,
    )
    try:
        shape = spec_of(cfg.model).planner_shape
        reports = run_ranks(cfg, shape(cfg.model) if shape is not None else None, run, ranks)
    except DryRunError as exc:
        console.print(
            f"[bold red]the training code cannot run this layout[/bold red]: {exc}", soft_wrap=True
        )
        return False
    console.print(report_table(reports))
    if spec_of(cfg.model).planner_shape is not None:
        console.print(_peak_note(cfg, run), soft_wrap=True)
    off = [(r.rank, f.name) for r in reports for f in r.flagged]
    seconds = time.perf_counter() - start
    if off:
        listed = ", ".join(f"rank {rank} {figure}" for rank, figure in off)
        console.print(
            f"[bold red]{len(off)} figure(s) off the plan[/bold red] (exact for state, within "
            f"{100 * TOLERANCE:.0f}% otherwise): {listed} ({seconds:.1f} s)",
            soft_wrap=True,
        )
        return False
    console.print(f"every figure within the plan's bounds ({seconds:.1f} s)")
    return True


def _peak_note(cfg, run) -> str:
    """How the dry run's activations (one micro-batch) make the plan table's (the rank's peak)."""
    mem = layout_memory(as_run(cfg, run), run)
    flight = mem.detail["in_flight"]
    held = (
        f"{flight} micro-batches of {mem.detail['micro_batch']} images in flight ({run.schedule} "
        f"on pp={run.pp})"
        if flight > 1
        else f"one micro-batch of {mem.detail['micro_batch']} images"
    )
    extra = (
        ", plus one block's full set while it recomputes" if run.activation_checkpointing else ""
    )
    return (
        "activations above: what one micro-batch leaves saved on the rank; the plan's "
        f"activations at the peak of its busiest rank (the table's column): {held}{extra}, "
        f"{mem.activations / 1e9:.4g} GB"
    )
