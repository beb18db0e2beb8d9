"""A layout named by hand, fitted to the device before any rank starts (`resolve` asks `fit` for
every named layout, so `tools/train.py`, `tools/plan.py`, `tools/k8s.py`, a pod and every srun /
torchrun task decide alike).

The named layout (`parallel=tp4`, `parallel.pp=2`, `parallel=ddp`, ...) is planned as
`parallel=auto` plans its candidates: the memory model's bytes on its busiest rank against
`parallel.headroom` of a device (the GPU's memory, or `parallel.device_memory_gb` where the
launching process sees no GPU). Over that budget, `parallel.fit=auto` (the default) keeps what was
named (dp, tp, pp, FSDP, offload, the schedule, a checkpointing setting) and adds what fits it at
the least cost in the planner's time model: more gradient accumulation (the global batch kept, the
micro-batch lowered, which lowers the matmuls' rate), selective checkpointing
(`checkpoint_keep=matmuls`: the elementwise work recomputed), whole-block checkpointing, or
accumulation with either; under a pipeline whose micro-batch count was left to its default, more
micro-batches a step (a smaller bubble, too). One line says what was added, the planned GB a device
before and after and the step-time cost. `parallel.fit=refuse` stops instead, naming the settings
that fit; `parallel.fit=off` runs the layout as named, with a warning. What fits no way is refused,
naming the layouts that would (the planner's best on the same devices).

Checked wherever a budget is known: on CUDA, and wherever `parallel.device_memory_gb` is set. A CPU
run without it is not (its ranks share the host's memory, which the OS pages), nor a detector (the
planner models ViTs).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, cast

from omegaconf import DictConfig, OmegaConf

from visiondist.config import ConfigError
from visiondist.config.layout import RunLayout
from visiondist.models.registry import spec_of
from visiondist.plan.budget import layout_memory, memory_budget, plan_for, planned_shape
from visiondist.plan.planner import ACCUMULATION_FACTORS, hardware_from_config
from visiondist.plan.time_model import Candidate, step_seconds
from visiondist.plan.world import devices_named

GB = 1e9
# ties: accumulation, then the least
LEVER_ORDER = {(False, "input"): 0, (True, "matmuls"): 1, (True, "input"): 2}


@dataclass(frozen=True)
class Option:
    """One way to run the named layout: its `RunLayout`, the planned bytes a device and the time
    model's step."""

    run: RunLayout
    device: int
    seconds: float

    def settings(self, asked: RunLayout) -> str:
        """The settings that ask for this option by hand on top of the named layout."""
        r, out = self.run, []
        if r.grad_accum != asked.grad_accum:
            out.append(f"trainer.grad_accum={r.grad_accum}")
        if r.microbatches != asked.microbatches:
            out.append(f"parallel.microbatches={r.microbatches}")
        if r.activation_checkpointing and not asked.activation_checkpointing:
            out.append("parallel.activation_checkpointing=true")
            if r.checkpoint_keep == "matmuls":
                out.append("parallel.checkpoint_keep=matmuls")
        return " ".join(out)

    @property
    def lever(self) -> tuple[bool, str]:
        return self.run.activation_checkpointing, self.run.checkpoint_keep


def budget(cfg: DictConfig, run: RunLayout) -> Optional[tuple[float, str]]:
    """GB of one rank's device that a named layout is fitted to, and where the figure comes from;
    None where nothing is checked (a detector; the CPU without parallel.device_memory_gb or
    parallel.gpu)."""
    if spec_of(cfg.model).planner_shape is None:
        return None
    if not devices_named(cfg.parallel) and (run.accelerator != "cuda" or not _cuda_readable()):
        return None
    return memory_budget(cfg, run.accelerator, run.per_node, run.share_gpu)


def _cuda_readable() -> bool:
    """Whether this process can read its GPU's memory (a world resolved for GPUs it does not have
    cannot)."""
    import torch  # noqa: PLC0415 (torch, 2 s: plan/ is torch-free)

    return torch.cuda.is_available()


def as_run(cfg: DictConfig, run: RunLayout) -> DictConfig:
    """`cfg` with the accumulation `run` was resolved to (what the ranks' trainer.grad_accum is)."""
    if not run.grad_accum or run.grad_accum == cfg.trainer.grad_accum:
        return cfg
    # a merge onto a DictConfig (OmegaConf types it DictConfig | ListConfig)
    return cast(DictConfig, OmegaConf.merge(cfg, {"trainer": {"grad_accum": run.grad_accum}}))


def fit(cfg: DictConfig, run: RunLayout) -> RunLayout:
    """`run`, a named layout, as it will run: unchanged where it fits its device or nothing is
    checked, else fitted (`parallel.fit=auto`), run as named (`off`), each with `fitted` saying so
    in one line, or refused (ConfigError naming the fix)."""
    found = budget(cfg, run)
    if found is None:
        return run
    memory, source = found
    hw = _hardware(cfg, run, memory)
    asked = _option(cfg, run, hw)
    if asked.device <= hw.budget:
        return run
    where = (
        f"the named layout {run.describe(on=devices_text(run, memory))} plans "
        f"{asked.device / GB:.3g} GB a device, over the {hw.budget / GB:.3g} GB budget "
        f"({100 * hw.headroom:.0f}% of {memory:.3g} GB: {source})"
        f"{_above_ddp(cfg, run, asked)}"
    )
    mode = str(cfg.parallel.fit)
    if mode == "off":  # said by the launcher (once a job) and recorded in layout.json, as a fit is
        return run.replace(fitted=f"parallel.fit=off: {where}; it runs as named, unfitted")
    fitting = [o for o in options(cfg, run, hw) if o.device <= hw.budget]
    if not fitting:
        raise ConfigError(
            f"{where}, and no accumulation or checkpointing fits it: {_elsewhere(cfg, run, memory)}"
        )
    if mode == "refuse":
        raise ConfigError(
            f"parallel.fit=refuse: {where}; settings that fit: {_listed(fitting, asked)} "
            "(parallel.fit=auto adds the first)"
        )
    best = fitting[0]
    line = (
        f"parallel.fit=auto: {where}: fitted with {best.settings(run)} "
        f"({_micro_text(cfg, best.run)}): {best.device / GB:.3g} GB planned, about "
        f"{best.seconds / asked.seconds:.2f}x the step time in the time model "
        f"(parallel.fit=refuse stops instead){_faster(cfg, run, memory, best)}"
    )
    return best.run.replace(fitted=line)  # the resolver makes its compile switches concrete again


def options(cfg: DictConfig, run: RunLayout, hw) -> list:
    """Every way to run `run` with more accumulation (from trainer.grad_accum up), checkpointing
    where none was named (selective, whole blocks) and, under a pipeline whose micro-batch count was
    left to its default, more micro-batches a step: fastest first in the time model (ties:
    accumulation before checkpointing, the least of it)."""
    levers = (
        [(True, run.checkpoint_keep)]
        if run.activation_checkpointing
        else [(False, "input"), (True, "matmuls"), (True, "input")]
    )
    counts = (
        [run.microbatches * k for k in (1, 2, 4, 8)]
        if run.pp > 1 and cfg.parallel.microbatches == -1
        else [run.microbatches]
    )
    depth = int(cfg.model.depth)
    out = []
    for factor in ACCUMULATION_FACTORS:
        accum = _accum(cfg, run) * factor
        for m in counts:
            if not _splits(cfg, run.dp, accum, m if run.pp > 1 else 1):
                continue
            for ckpt, keep in levers:
                blocks = (
                    run.checkpoint_blocks
                    if run.activation_checkpointing
                    else (depth if ckpt else 0)
                )
                variant = run.replace(
                    grad_accum=accum,
                    microbatches=m,
                    activation_checkpointing=ckpt,
                    checkpoint_keep=keep,
                    checkpoint_blocks=blocks,
                )
                out.append(_option(cfg, variant, hw))
    return sorted(out, key=lambda o: (round(o.seconds, 12), LEVER_ORDER[o.lever], o.run.grad_accum))


def _accum(cfg: DictConfig, run: RunLayout) -> int:
    return run.grad_accum or int(cfg.trainer.grad_accum)


def _splits(cfg: DictConfig, dp: int, accum: int, microbatches: int) -> bool:
    """Whether the global batch splits into whole micro-batches (even ones where mixup / cutmix pair
    images)."""
    d = cfg.data
    step = dp * accum * microbatches
    if d.batch_size % step:
        return False
    micro = d.batch_size // step
    return not ((d.mixup > 0 or d.cutmix > 0) and micro % 2)


def _hardware(cfg: DictConfig, run: RunLayout, memory: float):
    return hardware_from_config(cfg.parallel, run.world_size, run.nodes, memory)


def _option(cfg: DictConfig, run: RunLayout, hw) -> Option:
    run = run if run.grad_accum else run.replace(grad_accum=int(cfg.trainer.grad_accum))
    mem = layout_memory(cfg, run)
    seconds = step_seconds(
        planned_shape(cfg),
        Candidate.of(run),
        hw,
        int(cfg.data.batch_size),
        mem,
        str(cfg.trainer.precision),
    )["total"]
    return Option(run, mem.device, seconds)


def _above_ddp(cfg: DictConfig, run: RunLayout, asked: Option) -> str:
    """Why a tensor-parallel layout plans more a device than plain DDP on the same devices, where it
    does: its fewer DP ranks each compute a larger share of the global batch, and without sequence
    parallelism its LayerNorm and residual activations are whole on every tp rank; "" otherwise."""
    if run.tp == 1:
        return ""
    plain = RunLayout(
        run.accelerator,
        run.world_size,
        run.per_node,
        dp=run.world_size,
        grad_accum=asked.run.grad_accum,
    )
    ddp = layout_memory(cfg, plain).device
    if asked.device <= ddp:
        return ""
    whole = "" if run.sequence_parallel else " (parallel.sequence_parallel=true splits the rest)"
    return (
        f"; plain DDP plans {ddp / GB:.3g} GB: here each of the dp={run.dp} ranks computes "
        f"{run.world_size // run.dp}x a ddp{run.world_size} rank's images "
        f"({_micro_text(cfg, asked.run)}) and tp={run.tp} splits only their attention and MLP "
        f"activations{whole}"
    )


def devices_text(run: RunLayout, memory: float) -> str:
    """'4 GPUs of 80 GB' (on CUDA), '4 devices of 80 GB' (parallel.device_memory_gb elsewhere, e.g.
    planned on a machine without the GPUs): the devices a layout was planned for."""
    kind = "GPU" if run.accelerator == "cuda" else "device"
    return f"{run.world_size} {kind}{'s' if run.world_size > 1 else ''} of {memory:.3g} GB"


def _micro_text(cfg: DictConfig, run: RunLayout) -> str:
    micro = int(cfg.data.batch_size) // (
        run.dp * run.grad_accum * (run.microbatches if run.pp > 1 else 1)
    )
    return f"micro-batch {micro} a rank"


def _listed(fitting: list[Option], asked: Option, most: int = 3) -> str:
    """The fastest fitting option of each lever kind (accumulation alone, selective, whole blocks),
    best first."""
    shown: dict[tuple[bool, str], Option] = {}
    for option in fitting:
        shown.setdefault(option.lever, option)
    return "; ".join(
        f"{o.settings(asked.run)} ({o.device / GB:.3g} GB, {o.seconds / asked.seconds:.2f}x the "
        "step)"
        for o in list(shown.values())[:most]
    )


def _faster(cfg: DictConfig, run: RunLayout, memory: float, fitted: Option) -> str:
    """'; parallel=auto would choose ...' when the planner's choice on these devices is over 10%
    faster than the fitted layout in the time model (what the user named is kept; this only says
    what it costs)."""
    plan = plan_for(cfg, run.world_size, run.nodes, memory, run.accelerator)
    if plan.choice is None or plan.choice.seconds["total"] > 0.9 * fitted.seconds:
        return ""
    return (
        f"; parallel=auto would choose {plan.choice.candidate.name} on these devices, about "
        f"{plan.choice.seconds['total'] / fitted.seconds:.2f}x this step in the time model"
    )


def _elsewhere(cfg: DictConfig, run: RunLayout, memory: float) -> str:
    """The planner's best layouts on the same devices (or its smallest device count that fits)."""
    plan = plan_for(cfg, run.world_size, run.nodes, memory, run.accelerator)
    if plan.choice is None:
        return plan.reason
    fits = [r for r in plan.rows if r.fits][:3]
    named = "; ".join(
        f"{r.candidate.name} ({r.memory.device / GB:.3g} GB): {r.candidate.settings()}"
        for r in fits
    )
    return (
        f"layouts that fit these devices: {named} (tools/plan.py shows them all; "
        "parallel=auto chooses for you)"
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """A CUDA out-of-memory (torch.cuda.OutOfMemoryError, raised by the caching allocator)."""
    import torch  # noqa: PLC0415 (torch, 2 s: plan/ is torch-free)

    return isinstance(exc, torch.cuda.OutOfMemoryError)


def out_of_memory_cause(cfg: DictConfig, run: RunLayout, exc: BaseException) -> str:
    """The cause part of a rank's failure line for a CUDA out-of-memory: what the allocator said, in
    one clause; the plan's figure for the layout as it ran; and the settings the plan puts at three
    quarters of that figure (with `parallel.headroom` that makes the fit add them by itself)."""
    text = str(exc)
    asked = re.search(r"Tried to allocate ([\d.]+ [KMGT]iB)", text)
    total = re.search(
        r"total capacity of ([\d.]+ [KMGT]iB) of which ([\d.]+ [KMGT]iB) is free", text
    )
    said = (
        "CUDA out of memory"
        + (f" (tried to allocate {asked[1]}" if asked else "")
        + (f"; {total[2]} of {total[1]} free)" if total else ")" if asked else "")
    )
    if spec_of(cfg.model).planner_shape is None:
        return (
            f"{said}: {cfg.model.name}'s memory is not planned (the planner models ViTs); lower "
            "data.batch_size or raise trainer.grad_accum"
        )
    memory = memory_budget(cfg, run.accelerator, run.per_node, run.share_gpu)[0]
    hw = _hardware(cfg, run, memory)
    planned = _option(cfg, run, hw)
    line = (
        f"{said}: the plan put {run.describe(on=devices_text(run, memory))} at "
        f"{planned.device / GB:.3g} GB a device ({hw.budget / GB:.3g} GB budget)"
    )
    target = 0.75 * planned.device
    smaller = [o for o in options(cfg, run, hw) if o.device <= target]
    if not smaller:
        return (
            line + "; no accumulation or checkpointing plans it smaller: tools/plan.py lists the "
            "layouts that fit"
        )
    headroom = math.floor(100 * target / (memory * GB)) / 100
    return (
        line
        + f"; planned at 3/4 of that: {smaller[0].settings(run)} ({smaller[0].device / GB:.3g} "
        f"GB), or parallel.headroom={headroom:.2f}, with which the fit finds such settings by "
        "itself"
    )
