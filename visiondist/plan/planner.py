"""The layout search over the memory model of `visiondist.plan.memory`.

`plan` enumerates the layouts the trainer can run on a number of devices (TP inside a node, dividing
the heads; pipeline stages with their best micro-batch count; FSDP with or without offload), each
with its memory levers: activation checkpointing (selective, `checkpoint_keep=matmuls`, or whole
blocks) and gradient accumulation (the global batch kept, the micro-batch lowered: each row takes
the least accumulation that makes it fit). It keeps those whose busiest rank fits the device with
headroom, and ranks them by a simple time model: FLOPs (`visiondist.models.flops.vit_train_flops`) /
device rate (lower for matmuls of few rows, i.e. small micro-batches), with the pipeline bubble and
what checkpointing recomputes, plus collective bytes / link bandwidth (NVLink-class inside a node,
network between nodes, PCIe to the host); data-parallel traffic is hidden under the backward (DDP)
or the whole step (FSDP) up to the compute time. The model ranks layouts; it does not predict wall
time. `visiondist.plan.fit` ranks the same levers for one layout named by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from visiondist.config.layout import divisors
from visiondist.models.flops import vit_train_flops
from visiondist.models.shape import ViTShape
from visiondist.plan.memory import (
    FLOAT,
    GB,
    RankMemory,
    block_params,
    collective_bytes,
    optimizer_bytes,
    rank_memory,
)

HOST_MEMORY_GBS = 50.0  # host memory bandwidth for the offloaded (CPU) optimizer step
# a row's note: it fits the devices, but its offloaded state does not fit the node's host memory
HOST_FULL = "host"
# a matmul with this many rows (tokens of a micro-batch) runs at half the device's rate
GEMM_HALF_ROWS = 512
# What `checkpoint_keep=matmuls` recomputes, as a fraction of the step: the forward's elementwise
# work (norms, GELU, residual adds). ViT-H/14's compiled bf16 step on an H100 spent 32% in fused
# elementwise and norm kernels, forward and backward (benchmarks/RESULTS.md); the forward's share of
# that is about a third.
ELEMENTWISE_RECOMPUTE = 0.11
# none, selective, whole blocks
CHECKPOINTING = ((False, "input"), (True, "matmuls"), (True, "input"))
ACCUMULATION_FACTORS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # times the configured trainer.grad_accum


# --------------------------------------------------------------------------------------------------
# Time model and the layout search


@dataclass(frozen=True)
class Hardware:
    devices: int
    nodes: int = 1
    memory_gb: float = 80.0
    headroom: float = 0.9
    tflops: float = 400.0
    intra_node_gbs: float = 300.0
    inter_node_gbs: float = 25.0
    host_gbs: float = 25.0
    host_memory_gb: float = 0.0  # per node; 0: not checked
    # the devices are the host's memory (the CPU): offload moves nothing off them
    shared_host: bool = False

    @property
    def per_node(self) -> int:
        return self.devices // self.nodes

    @property
    def budget(self) -> float:
        return self.headroom * self.memory_gb * GB

    @property
    def host_budget(self) -> float:
        return self.headroom * self.host_memory_gb * GB

    def host_fits(self, mem: RankMemory) -> bool:
        """Whether a node's ranks' offloaded state (with their device bytes, where the devices are
        the host) fits the host's memory."""
        if not mem.offloaded or not self.host_memory_gb:
            return True
        return (
            self.per_node * (mem.host + (mem.device if self.shared_host else 0)) <= self.host_budget
        )


@dataclass(frozen=True)
class Candidate:
    dp: int
    tp: int = 1
    pp: int = 1
    fsdp: bool = False
    offload: bool = False
    checkpointing: bool = False
    microbatches: int = 1
    shard: int = 0  # FSDP's shard group (HSDP when < dp); 0: every DP rank
    # micro-batches (pipeline steps) accumulated per optimizer step: trainer.grad_accum
    accum: int = 1
    # with checkpointing, what a block keeps: its input, or its matmuls' outputs too
    keep: str = "input"

    @classmethod
    def of(cls, run) -> Candidate:
        """The candidate of a resolved `RunLayout` (its accumulation: `run.grad_accum`)."""
        return cls(
            run.dp,
            run.tp,
            run.pp,
            run.fsdp,
            run.offload,
            run.activation_checkpointing,
            run.microbatches if run.pp > 1 else 1,
            run.shard_size if run.hsdp else 0,
            max(1, run.grad_accum),
            run.checkpoint_keep if run.activation_checkpointing else "input",
        )

    @property
    def name(self) -> str:
        parts = []
        if self.fsdp and 0 < self.shard < self.dp:
            parts.append(f"hsdp{self.dp}(shard {self.shard})")
        elif self.fsdp:
            parts.append(f"fsdp{self.dp}")
        elif self.dp > 1 or (self.tp == 1 and self.pp == 1):
            parts.append(f"ddp{self.dp}" if self.dp > 1 else "1 device")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}(m={self.microbatches})")
        text = " x ".join(parts)
        ckpt = (
            (" +ckpt(matmuls)" if self.keep == "matmuls" else " +ckpt")
            if self.checkpointing
            else ""
        )
        return (
            text
            + (" +offload" if self.offload else "")
            + ckpt
            + (f" +accum{self.accum}" if self.accum > 1 else "")
        )

    def overrides(self) -> dict:
        """The `parallel.*` fields that select this layout (its accumulation is
        `trainer.grad_accum`: `settings`)."""
        out: dict[str, Any] = {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "fsdp": self.fsdp,
            "offload": self.offload,
            "activation_checkpointing": self.checkpointing,
            "shard_size": self.shard if self.fsdp else 0,
        }
        if self.checkpointing:
            out["checkpoint_keep"] = self.keep
        if self.pp > 1:
            out.update(schedule="1f1b", stages_per_rank=1, microbatches=self.microbatches)
        return out

    def settings(self) -> str:
        """The command-line settings that select this layout by hand, accumulation included (what is
        off left out)."""
        shown = {
            k: v
            for k, v in self.overrides().items()
            if v is not False and not (k == "shard_size" and not v)
        }
        fields = " ".join(
            f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in shown.items()
        )
        return fields + (f" trainer.grad_accum={self.accum}" if self.accum > 1 else "")


def step_seconds(
    s: ViTShape,
    c: Candidate,
    hw: Hardware,
    global_batch: int,
    mem: RankMemory,
    precision: str = "32",
) -> dict:
    """Estimated seconds per optimizer step: compute (with the 1F1B bubble, what checkpointing
    recomputes, and the lower rate of small micro-batches, which accumulation makes), plus each
    collective's bytes (`collective_bytes`, the dry run's figures) over the link it crosses as ring
    algorithms move them (TP inside a node; DP / PP over the network once they span nodes; offload
    over PCIe), less what overlaps with compute."""
    world = c.dp * c.tp * c.pp
    rate = hw.tflops * 1e12
    grad_accum = c.accum
    # rows of every matmul: small ones run below the peak
    micro_tokens = mem.detail["micro_batch"] * s.tokens
    efficiency = micro_tokens / (micro_tokens + GEMM_HALF_ROWS)
    # matmuls kept: only elementwise work runs again
    whole_blocks = c.checkpointing and c.keep != "matmuls"
    compute = global_batch * vit_train_flops(s, whole_blocks) / (world * rate * efficiency)
    if c.checkpointing and c.keep == "matmuls":
        compute *= 1 + ELEMENTWISE_RECOMPUTE
    if c.pp > 1:
        compute *= (c.microbatches + c.pp - 1) / c.microbatches
    multi_node = world > hw.per_node
    dp_bw = (hw.inter_node_gbs if c.dp * c.tp > hw.per_node else hw.intra_node_gbs) * GB
    rank = mem.detail["rank"]
    moved = collective_bytes(
        s,
        mem,
        c.dp,
        c.tp,
        c.pp,
        grad_accum,
        precision,
        c.fsdp,
        whole_blocks,
        stage_ids=(rank,),
        n_stages=c.pp,
    )
    shard = c.shard or c.dp

    # bytes one rank sends for the payloads of `dim`'s collectives
    def wire(dim: str, n: int) -> float:
        ring = (n - 1) / n if n > 1 else 0.0
        return (
            2 * ring * moved.get(f"{dim} all_reduce", 0)
            + ring * (moved.get(f"{dim} all_gather", 0) + moved.get(f"{dim} reduce_scatter", 0))
            + moved.get(f"{dim} send", 0)
        )

    # HSDP: gathers inside the node, the gradient shards' all-reduce across nodes
    if c.fsdp and shard < c.dp:
        ring, cross = (shard - 1) / shard, (c.dp // shard - 1) / (c.dp // shard)
        dp_seconds = ring * (moved.get("dp all_gather", 0) + moved.get("dp reduce_scatter", 0)) / (
            hw.intra_node_gbs * GB
        ) + 2 * cross * moved.get("dp all_reduce", 0) / (hw.inter_node_gbs * GB)
    else:
        dp_seconds = wire("dp", c.dp) / dp_bw
    comm = {
        "dp": dp_seconds,
        "tp": wire("tp", c.tp) / (hw.intra_node_gbs * GB),
        "pp": wire("pp", c.pp) / ((hw.inter_node_gbs if multi_node else hw.intra_node_gbs) * GB),
        "host": 0.0,
    }
    if c.offload:  # shards up twice (forward, backward), gradients down; AdamW on the host
        comm["host"] = 3 * mem.params / (hw.host_gbs * GB) + 7 * mem.params / (HOST_MEMORY_GBS * GB)
    # DDP's bucketed all-reduce runs under the backward (2/3 of the compute), FSDP's gathers and
    # reduce-scatters under the forward and backward (prefetch); TP's all-reduces are on the
    # critical path; offload copies too.
    hidden = compute * (1.0 if c.fsdp else 2 / 3)
    exposed = {**comm, "dp": max(0.0, comm["dp"] - hidden)}
    return {"compute": compute, **exposed, "total": compute + sum(exposed.values())}


@dataclass
class PlanRow:
    candidate: Candidate
    memory: Optional[RankMemory]
    seconds: Optional[dict]
    fits: bool
    note: str = ""

    def planned(self) -> tuple[RankMemory, dict]:
        """(memory, step seconds) of a row that was planned: every row that fits; a row without
        them (a split that cannot be made) names why in `note`."""
        if self.memory is None or self.seconds is None:
            raise ValueError(f"{self.candidate.name} was not planned: {self.note}")
        return self.memory, self.seconds


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


def _duration(seconds: float) -> str:
    return (
        f"{seconds:.3g} s"
        if seconds >= 10
        else f"{seconds:.2f} s"
        if seconds >= 1
        else f"{1e3 * seconds:.3g} ms"
    )


@dataclass
class Plan:
    shape: ViTShape
    hardware: Hardware
    global_batch: int
    rows: list[PlanRow]
    choice: Optional[PlanRow]
    reason: str
    # bytes of one whole block's parameters, gradients, optimizer state (and EMA)
    layer_state: int = 0
    grad_accum: int = 1  # the configured accumulation, which plain DDP keeps

    @property
    def plain_ddp(self) -> bool:
        """Whether the choice is plain DDP as configured (no checkpointing, no more
        accumulation)."""
        return self.choice is not None and self.choice.candidate == Candidate(
            self.hardware.devices, accum=self.grad_accum
        )

    def table(self, title: str = ""):
        """A rich Table: per-rank GB by component, estimated step time, fits."""
        # rich where a table is drawn: 30-50 ms of `tools/train.py --cfg job`, which draws none
        from rich.table import Table  # noqa: PLC0415 (rich: 30-50 ms, drawn on demand)

        table = Table(
            title=title or None,
            title_justify="left",
            caption="GB per device (busiest rank, 1 GB = 1e9 bytes); each layout with the least "
            "accumulation (+accumN) that fits it; micro: images a rank computes at once "
            "(global batch / dp / accumulation / pipeline micro-batches); state = "
            "parameters + gradients + optimizer (+ EMA); activations: at the rank's peak "
            "(every micro-batch in flight); step: time model",
            caption_justify="left",
        )
        table.add_column("layout", no_wrap=True)
        for col in ("micro", "state", "activations", "buffers", "device", "host", "step", "fits"):
            table.add_column(col, justify="right")
        for row in self.rows:
            m = row.memory
            chosen = row is self.choice
            cells = [row.candidate.name]
            if m is None or row.seconds is None:  # both or neither: a row that was not planned
                cells += ["-"] * 6 + ["-", f"no: {row.note}"]
            else:
                cells += [
                    str(m.detail["micro_batch"]),
                    f"{m.state / GB:.2f}",
                    f"{m.activations / GB:.2f}",
                    f"{m.buffers / GB:.2f}",
                    f"{m.device / GB:.2f}",
                    f"{m.host / GB:.2f}" if m.offloaded else "-",
                    _duration(row.seconds["total"]),
                    "yes" if row.fits else f"no: {row.note}" if row.note else "no",
                ]
            table.add_row(
                *cells, style="bold green" if chosen else ("dim" if not row.fits else None)
            )
        return table

    def text(self, title: str = "", width: int = 120) -> str:
        from rich.console import Console  # noqa: PLC0415 (rich: 30-50 ms, drawn on demand)

        console = Console(width=width, record=True, file=open("/dev/null", "w"))
        console.print(self.table(title))
        return console.export_text()

    def to_json(self) -> dict:
        return {
            "hardware": self.hardware.__dict__,
            "global_batch": self.global_batch,
            "layer_state_gb": self.layer_state / GB,
            "choice": None if self.choice is None else self.choice.candidate.__dict__,
            "reason": self.reason,
            "rows": [
                {
                    "layout": r.candidate.name,
                    **r.candidate.__dict__,
                    "fits": r.fits,
                    "note": r.note,
                    **(
                        {
                            "micro_batch": r.memory.detail["micro_batch"],
                            "device_gb": r.memory.device / GB,
                            "host_gb": r.memory.host / GB,
                            "state_gb": r.memory.state / GB,
                            "activations_gb": r.memory.activations / GB,
                            "buffers_gb": r.memory.buffers / GB,
                            "step_s": r.seconds["total"],
                        }
                        if r.memory and r.seconds
                        else {}
                    ),
                }
                for r in self.rows
            ],
        }


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
        f"; the time model puts {fastest.candidate.name} at {_duration(seconds)} a step against "
        f"DDP's {_duration(ddp_seconds)} ({ddp_seconds / seconds:.2g}x): "
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
                f"device, about {_duration(seconds['total'])} per step in the time model"
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
        float(p.device_tflops),
        float(p.intra_node_gbs),
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
