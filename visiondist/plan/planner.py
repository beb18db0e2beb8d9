"""The layout search: `plan` enumerates the layouts the trainer can run on a number of devices (TP
inside a node, dividing the heads; pipeline stages with their best micro-batch count; FSDP with or
without offload), each with its memory levers: activation checkpointing (selective,
`checkpoint_keep=matmuls`, or whole blocks) and gradient accumulation (the global batch kept, the
micro-batch lowered: each row takes the least accumulation that makes it fit). It keeps those whose
busiest rank fits the device with headroom (the memory model, `visiondist.plan.memory`), and ranks
them by the time model (`visiondist.plan.time_model.step_seconds`). Its result is a
`visiondist.plan.table.Plan`. `visiondist.plan.fit` ranks the same levers for one layout named by
hand.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from visiondist.config.layout import divisors
from visiondist.models.shape import ViTShape
from visiondist.plan.memory import (
    FLOAT,
    GB,
    block_params,
    optimizer_bytes,
    rank_memory,
)
from visiondist.plan.table import Plan, PlanRow, duration
from visiondist.plan.time_model import Candidate, Hardware, step_seconds
from visiondist.plan.world import device_tflops, intra_node_gbs

# a row's note: it fits the devices, but its offloaded state does not fit the node's host memory
HOST_FULL = "host"
# none, selective, whole blocks
CHECKPOINTING = ((False, "input"), (True, "matmuls"), (True, "input"))
ACCUMULATION_FACTORS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # times the configured trainer.grad_accum


# --------------------------------------------------------------------------------------------------
# The layout search


def layouts(s: ViTShape, hw: Hardware) -> list[Candidate]:
    """Every mesh and sharding the trainer runs on `hw.devices` devices (TP inside a node dividing
    the heads, pipeline depths, FSDP with and without offload, HSDP across nodes), each without
    checkpointing, with selective (`matmuls`) and with whole-block checkpointing; accumulation and
    micro-batch counts are chosen per row (`_fitted_row`)."""
    out = []
    for tp in divisors(hw.per_node):
        if s.num_heads % tp or s.hidden % tp:
            continue
        for pp in divisors(hw.devices // tp):
            if pp > s.depth:
                continue
            dp = hw.devices // (tp * pp)
            shardings = [(False, False, 0)]
            if tp == 1 and pp == 1:
                shardings += [(True, False, 0), (True, True, 0)] if dp > 1 else [(True, True, 0)]
                # HSDP: shard inside a node, replicate across nodes
                if hw.nodes > 1 and hw.per_node > 1:
                    shardings.append((True, False, hw.per_node))
            for fsdp, offload, shard in shardings:
                out += [
                    Candidate(dp, tp, pp, fsdp, offload, ckpt, 1, shard, keep=keep)
                    for ckpt, keep in CHECKPOINTING
                ]
    return out


def splits(global_batch: int, dp: int, pp: int, grad_accum: int) -> list[tuple[int, list[int]]]:
    """(accumulation, micro-batch counts of a pipeline step) that split `global_batch` evenly over
    `dp` ranks, least accumulation first: `grad_accum` x 1, 2, 4, ...; under a pipeline 1, 2, 4 or 8
    x pp micro-batches a step (an accumulation with no count that splits is listed with none)."""
    out = []
    for factor in ACCUMULATION_FACTORS:
        accum = grad_accum * factor
        if global_batch % (dp * accum):
            break
        local = global_batch // (dp * accum)
        out.append(
            (accum, [k * pp for k in (1, 2, 4, 8) if local % (k * pp) == 0] if pp > 1 else [1])
        )
    return out


def _row(s, hw, c: Candidate, global_batch, optimizer, ema, precision) -> PlanRow:
    mem = rank_memory(
        s,
        c.dp,
        c.tp,
        c.pp,
        global_batch,
        c.accum,
        optimizer,
        ema,
        precision,
        microbatches=c.microbatches if c.pp > 1 else -1,
        fsdp=c.fsdp,
        offload=c.offload,
        checkpointing=c.checkpointing,
        shard_size=c.shard,
        keep=c.keep,
    )
    if mem.detail["micro_batch"] < 1:
        return PlanRow(c, None, None, False, "fewer than one image per micro-batch")
    device_fits, host_fits = mem.device <= hw.budget, hw.host_fits(mem)
    return PlanRow(
        c,
        mem,
        step_seconds(s, c, hw, global_batch, mem, precision),
        device_fits and host_fits,
        "" if host_fits or not device_fits else HOST_FULL,
    )


def _rank(row: PlanRow) -> tuple:
    return row.memory is None, not row.fits, row.seconds["total"] if row.seconds else 0


def _fitted_row(
    s, hw, layout: Candidate, global_batch, grad_accum, optimizer, ema, precision
) -> PlanRow:
    """`layout`'s row with the least accumulation at which it fits (from `grad_accum` up: more only
    lowers the micro-batch, and with it the rate), under a pipeline with its best micro-batch count
    there (fits first, then time); when it fits at none, its row at `grad_accum`."""
    split = splits(global_batch, layout.dp, layout.pp, grad_accum)
    if not split:
        why = f"batch {global_batch} is not divisible by dp x grad_accum = {layout.dp * grad_accum}"
        return PlanRow(
            replace(layout, microbatches=2 * layout.pp if layout.pp > 1 else 1, accum=grad_accum),
            None,
            None,
            False,
            why,
        )

    def best_of(accum: int, counts: list[int]) -> Optional[PlanRow]:
        rows = [
            _row(
                s,
                hw,
                replace(layout, accum=accum, microbatches=m),
                global_batch,
                optimizer,
                ema,
                precision,
            )
            for m in counts
        ]
        return min(rows, key=_rank) if rows else None

    first = best_of(*split[0])
    if first is None:
        local = global_batch // (layout.dp * grad_accum)
        why = (
            f"{local} images per DP rank do not split into a multiple of {layout.pp} micro-batches"
        )
        first = PlanRow(
            replace(layout, microbatches=2 * layout.pp, accum=grad_accum), None, None, False, why
        )
    if first.fits or len(split) == 1:
        return first
    # the least memory accumulation gives: when even that does not fit, none does
    least = best_of(*split[-1])
    if least is None or not least.fits:
        return first
    for accum, counts in split[1:-1]:
        row = best_of(accum, counts)
        if row is not None and row.fits:
            return row
    return least


def _evaluate(s, hw, global_batch, grad_accum, optimizer, ema, precision) -> list[PlanRow]:
    return [
        _fitted_row(s, hw, c, global_batch, grad_accum, optimizer, ema, precision)
        for c in layouts(s, hw)
    ]


def _complexity(c: Candidate) -> tuple:
    return (
        c.offload,
        c.fsdp,
        c.shard > 0,
        c.pp > 1,
        c.tp > 1,
        c.checkpointing,
        c.keep == "input",
        c.accum,
        c.pp,
        c.tp,
    )


# a layout the time model puts this much faster than plain DDP is named beside DDP's choice
FASTER = 1.2
# ...where DDP's step is at least this long on a GPU: below it the kernel launches and the host's
# work a step, which the time model does not count, decide (and on the CPU it is not calibrated)
TIMED_FROM_S = 0.01


def _faster_than_ddp(fit: list, ddp_seconds: float, hw: Hardware) -> str:
    """The fastest layout that fits, where the time model puts it `FASTER` times ahead of the plain
    DDP parallel=auto keeps (the layout of fewest parts, and the one the time model knows best): its
    figure and the settings that select it; "" otherwise, on the CPU, and for a DDP step under
    `TIMED_FROM_S`."""
    timed = [r for r in fit if r.seconds]
    if not timed or ddp_seconds < TIMED_FROM_S or hw.shared_host:
        return ""
    fastest = min(timed, key=lambda r: r.planned()[1]["total"])
    seconds = fastest.planned()[1]["total"]
    if ddp_seconds < FASTER * seconds:
        return ""
    return (
        f"; the time model puts {fastest.candidate.name} at {duration(seconds)} a step against "
        f"DDP's {duration(ddp_seconds)} ({ddp_seconds / seconds:.2g}x): "
        f"{fastest.candidate.settings()} selects it"
    )


def plan(
    s: ViTShape,
    hw: Hardware,
    global_batch: int,
    grad_accum: int = 1,
    optimizer: str = "adamw",
    ema: bool = False,
    precision: str = "32",
    max_nodes: int = 1024,
) -> Plan:
    """The candidates on `hw`, plain DDP when it fits, else the fastest that fits (ties: the simpler
    layout), and why it was chosen. When none fits, `choice` is None and `reason` names the smallest
    device count (whole nodes) on which one would."""
    rows = _evaluate(s, hw, global_batch, grad_accum, optimizer, ema, precision)
    block = block_params(s)
    layer = (3 if ema else 2) * FLOAT * block.elements + optimizer_bytes(block, optimizer)
    fit = [r for r in rows if r.fits]
    rows.sort(
        key=lambda r: (
            r.memory is None,
            not r.fits,
            r.seconds["total"] if r.seconds else 0,
            _complexity(r.candidate),
        )
    )
    budget = f"{hw.budget / GB:.3g} GB ({100 * hw.headroom:.0f}% of {hw.memory_gb:.3g} GB)"
    # DDP as configured: no checkpointing, no more accumulation
    plain = Candidate(hw.devices, accum=grad_accum)
    ddp = (
        _row(s, hw, plain, global_batch, optimizer, ema, precision)
        if global_batch % (hw.devices * grad_accum) == 0
        else None
    )
    # plain DDP whenever it fits; otherwise the fastest layout that fits (ties: the simpler)
    if fit:
        best = (
            next(r for r in rows if r.candidate == plain)
            if ddp is not None and ddp.fits
            else min(
                fit, key=lambda r: (round(r.planned()[1]["total"], 12), _complexity(r.candidate))
            )
        )
        m, seconds = best.planned()
        if best.candidate == plain:
            reason = (
                "the training state and activations fit each device under DDP, "
                f"{m.device / GB:.3g} GB needed ({m.state / GB:.3g} GB of state, "
                f"{(m.activations + m.buffers) / GB:.3g} GB of activations and buffers) of "
                f"{budget} allowed"
            ) + _faster_than_ddp(fit, seconds["total"], hw)
        else:
            why_not = (
                f"DDP would need {ddp.memory.device / GB:.3g} GB per device, over the {budget} "
                "budget"
                if ddp is not None and ddp.memory is not None
                else f"DDP cannot run: {ddp.note}"
                if ddp is not None
                else f"DDP cannot run: batch {global_batch} is not divisible by dp x grad_accum = "
                f"{hw.devices * grad_accum}"
            )
            of = (
                f"the fastest of {len(fit)} layouts that fit"
                if len(fit) > 1
                else "the only layout that fits"
            )
            reason = (
                f"{why_not}; {best.candidate.name} is {of}: {m.device / GB:.3g} GB per "
                f"device, about {duration(seconds['total'])} per step in the time model"
            )
        return Plan(s, hw, global_batch, rows, best, reason, layer, grad_accum)
    smallest = None
    per_node = hw.per_node
    for nodes in range(hw.nodes + 1, max_nodes + 1):
        bigger = replace(hw, devices=nodes * per_node, nodes=nodes)
        if any(
            r.fits
            for r in _evaluate(s, bigger, global_batch, grad_accum, optimizer, ema, precision)
        ):
            smallest = bigger
            break
    host = ""
    if any(r.note == HOST_FULL for r in rows):  # offload would fit the devices, not the hosts
        host = (
            f" and {hw.host_budget / GB:.4g} GB ({100 * hw.headroom:.0f}% of "
            f"{hw.host_memory_gb:.4g} GB) of host memory per node (parallel.host_memory_gb)"
        )
    if smallest is not None:
        reason = (
            f"no layout fits {hw.devices} devices of {budget}{host}: the smallest that fits is "
            f"{smallest.devices} devices ({smallest.nodes} nodes of {per_node})"
        )
    else:
        reason = (
            f"no layout fits {hw.devices} devices of {budget}{host}, nor any count up to "
            f"{max_nodes} nodes of {per_node}: use larger devices, a smaller batch or model, or "
            "bf16 precision"
        )
    return Plan(s, hw, global_batch, rows, None, reason, layer, grad_accum)


# --------------------------------------------------------------------------------------------------
# From a training config


def hardware_from_config(
    p,
    devices: int,
    nodes: int,
    memory_gb: float,
    host_memory_gb: float = 0.0,
    shared_host: bool = False,
) -> Hardware:
    return Hardware(
        devices,
        nodes,
        memory_gb,
        float(p.headroom),
        device_tflops(p),
        intra_node_gbs(p),
        float(p.inter_node_gbs),
        float(p.host_gbs),
        host_memory_gb,
        shared_host,
    )


def plan_config(
    shape: ViTShape,
    cfg,
    devices: int,
    nodes: int,
    memory_gb: float,
    host_memory_gb: float = 0.0,
    shared_host: bool = False,
) -> Plan:
    """`plan` for the model `shape` (its family's `planner_shape`: `visiondist.plan.plan_for`) and a
    composed training config (global batch, accumulation, optimizer, EMA, precision, the hardware
    figures)."""
    if nodes < 1 or devices % nodes:
        raise ValueError(f"{devices} devices do not split evenly over {nodes} nodes")
    t = cfg.trainer
    return plan(
        shape,
        hardware_from_config(cfg.parallel, devices, nodes, memory_gb, host_memory_gb, shared_host),
        int(cfg.data.batch_size),
        int(t.grad_accum),
        str(cfg.optim.name),
        float(t.ema_decay) > 0,
        str(t.precision),
    )
