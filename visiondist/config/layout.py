"""The parallel layout a run resolved to: `RunLayout`, frozen, every field concrete, plus the
pipeline arithmetic.

`visiondist.plan.resolve` makes one in the launching process (from the config, the environment and,
under `parallel=auto`, the planner); the ranks receive it and read their layout from it alone, never
from the `-1` / null conveniences of `parallel.*`. It is written to the run dir as `layout.json`
beside `config.yaml` (the run as asked). No torch here: the planner, validation and the CLI use the
arithmetic without importing the distributed code.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")  # several (virtual) stages per rank


def divisors(n: int) -> list[int]:
    """The degrees that split `n` evenly (e.g. tensor-parallel sizes for n heads), ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def stages_per_rank_for(schedule: str, stages_per_rank: int) -> int:
    """`parallel.stages_per_rank=-1`: 2 virtual stages per rank for the interleaved and zero-bubble
    schedules, 1 otherwise."""
    if stages_per_rank > 0:
        return stages_per_rank
    return 2 if schedule in MULTI_STAGE else 1


def microbatches_for(pp: int, microbatches: int) -> int:
    """`parallel.microbatches=-1`: 2 per pipeline rank, a bubble of about a third with GPipe /
    1F1B."""
    return microbatches if microbatches > 0 else 2 * pp


def check_pipeline(
    pp: int, schedule: str, stages_per_rank: int, microbatches: int, depth: int
) -> None:
    """Raise ValueError, naming the fix, for a pipeline torch's schedules would reject (or fail on
    mid-step)."""
    if schedule not in SCHEDULES:
        raise ValueError(
            f"parallel.schedule={schedule!r} is not supported: use one of {', '.join(SCHEDULES)}"
        )
    if pp == 1:
        return
    spr = stages_per_rank_for(schedule, stages_per_rank)
    m = microbatches_for(pp, microbatches)
    if schedule not in MULTI_STAGE and spr != 1:
        raise ValueError(
            f"parallel.schedule={schedule} runs one stage per rank but "
            f"parallel.stages_per_rank={spr}: set parallel.stages_per_rank=1, or use "
            "parallel.schedule=interleaved_1f1b or zero_bubble for several virtual stages per "
            "rank"
        )
    if pp * spr > depth:
        stages = (
            f"parallel.pp={pp}"
            if spr == 1
            else f"parallel.pp={pp} x parallel.stages_per_rank={spr} = {pp * spr}"
        )
        raise ValueError(
            f"{stages} pipeline stages exceed model.depth={depth}: each stage needs at least one "
            f"block; lower parallel.pp{'' if spr == 1 else ' or parallel.stages_per_rank'}"
        )
    if m < pp:
        raise ValueError(
            f"parallel.microbatches={m} < parallel.pp={pp}: every pipeline rank needs a "
            f"micro-batch in flight; use parallel.microbatches >= {pp} (e.g. {2 * pp}: a bubble "
            f"of {(pp - 1) / (3 * pp - 1):.0%})"
        )
    if schedule in MULTI_STAGE:
        rounds = max(1, m // pp)
        if m % rounds:
            good = [k * pp for k in range(1, 5)]
            raise ValueError(
                f"parallel.schedule={schedule} runs micro-batches in rounds of parallel.pp={pp}: "
                f"parallel.microbatches={m} must be a multiple of {rounds} (m // pp); "
                f"use e.g. {', '.join(map(str, good))}"
            )


def balance(costs: Sequence[int], n: int) -> list[tuple[int, int]]:
    """Cut `costs` into `n` non-empty contiguous ranges [start, end) minimising the largest range's
    sum."""
    if n > len(costs):
        raise ValueError(f"cannot cut {len(costs)} units into {n} stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest max-load of cutting units [0, i) into k ranges; exact DP (N and n are
    # small)
    inf = float("inf")
    best = [[inf] * (len(costs) + 1) for _ in range(n + 1)]
    cut = [[0] * (len(costs) + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, n + 1):
        for i in range(k, len(costs) + 1):
            for j in range(k - 1, i):
                load = max(best[k - 1][j], prefix[i] - prefix[j])
                if load < best[k][i]:
                    best[k][i], cut[k][i] = load, j
    ranges, i = [], len(costs)
    for k in range(n, 0, -1):
        j = cut[k][i]
        ranges.append((j, i))
        i = j
    return ranges[::-1]


@dataclass(frozen=True)
class RunLayout:
    """How a run is laid out, as it ran: ranks, mesh degrees and every parallel switch, with no
    sentinel left."""

    accelerator: str  # "cpu" or "cuda"
    world_size: int
    per_node: int  # ranks per node
    dp: int
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # with pp == 1: unused
    stages_per_rank: int = 1
    microbatches: int = 1  # per pipeline step and DP rank; 1 without a pipeline
    fsdp: bool = False
    # FSDP: DP ranks one shard group spans (HSDP replicates across the groups); = dp: plain FSDP
    shard_size: int = 0
    offload: bool = False
    activation_checkpointing: bool = False
    # blocks that recompute their activations (0 without activation checkpointing)
    checkpoint_blocks: int = 0
    # what a checkpointed block keeps: its input, or also its matmuls' outputs
    checkpoint_keep: str = "input"
    # micro-batches (pipeline steps) accumulated per optimizer step: trainer.grad_accum, or more
    # where a named layout was fitted to the device (`visiondist.plan.fit`); the ranks'
    # trainer.grad_accum is this. 0: the config's (a layout.json from before the field, a layout
    # built by hand)
    grad_accum: int = 0
    timeline: bool = False  # record one pipeline step's timeline
    compile: bool = False  # torch.compile (`trainer.compile`, auto: on CUDA where it wins)
    # with compile: "model" (the whole model, one graph) or "blocks" (each block; also what a
    # layout.json from before the scope existed meant); "none" when nothing is compiled
    compile_scope: str = "blocks"
    cuda_graphs: bool = False  # the compiled model replayed as CUDA graphs (`trainer.cuda_graphs`)
    under_torchrun: bool = False  # this process is one rank of a torchrun / srun job
    # a node's ranks on its GPU 0, over gloo (`trainer.share_gpu`: a correctness test)
    share_gpu: bool = False
    chosen_by: str = "config"  # "config", or "parallel=auto" (the planner)
    reason: str = ""  # why parallel=auto chose it
    # parallel=auto chose plain DDP as configured: no layout, checkpointing or accumulation of its
    # own (`Plan.plain_ddp`; a detector's; a continued run's first choice)
    plain_ddp: bool = False
    # a named layout over its device's budget: what was added to fit it, or that it runs as named
    # (`visiondist.plan.fit`), one line beginning with its parallel.fit
    fitted: str = ""

    def __post_init__(self) -> None:
        if self.dp * self.tp * self.pp != self.world_size or min(self.dp, self.tp, self.pp) < 1:
            raise ValueError(
                f"dp x tp x pp = {self.dp} x {self.tp} x {self.pp} is not the world size "
                f"{self.world_size}"
            )
        if self.fsdp and not self.shard_size:
            # plain FSDP: one group of every DP rank
            object.__setattr__(self, "shard_size", self.dp)

    @property
    def hsdp(self) -> bool:
        """FSDP sharding inside groups of `shard_size` DP ranks and replicating across them."""
        return self.fsdp and self.shard_size < self.dp

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.per_node)

    def describe(self, on: str = "") -> str:
        """`dp=2 tp=2 pp=1 (4 ranks on cpu) +SP +FSDP`, as the start-up line and the summary show
        it; `on`: where the ranks are, for a layout planned for devices this process does not have
        ("4 GPUs of 80 GB")."""
        ranks = (
            on
            or f"{self.world_size} rank{'s' if self.world_size > 1 else ''} on {self.accelerator}"
        )
        if self.share_gpu:
            ranks += ", sharing GPU 0 over gloo"
        fsdp = (
            f"+HSDP (shard {self.shard_size} x replicate {self.dp // self.shard_size})"
            if self.hsdp
            else "+FSDP"
        )
        extras = [
            ("+SP", self.sequence_parallel),
            (fsdp, self.fsdp),
            ("+offload", self.offload),
            (
                "+activation "
                f"checkpointing{' (keeps matmuls)' if self.checkpoint_keep == 'matmuls' else ''}",
                self.activation_checkpointing,
            ),
            (f"+accumulation x{self.grad_accum}", self.grad_accum > 1),
            (f"+compiled {self.compile_scope}", self.compile),
            ("+CUDA graphs", self.compile and self.cuda_graphs),
        ]
        return " ".join(
            [f"dp={self.dp} tp={self.tp} pp={self.pp} ({ranks})", *(t for t, on in extras if on)]
        )

    def parallel_overrides(self) -> dict[str, Any]:
        """The `parallel.*` values that select this layout by name (what `parallel=auto` would have
        to be told)."""
        out: dict[str, Any] = {"dp": self.dp, "tp": self.tp, "pp": self.pp}
        if self.sequence_parallel:
            out["sequence_parallel"] = True
        if self.pp > 1:
            out.update(
                schedule=self.schedule,
                stages_per_rank=self.stages_per_rank,
                microbatches=self.microbatches,
            )
        if self.fsdp:
            out.update(fsdp=True, offload=self.offload, shard_size=self.shard_size)
        if self.activation_checkpointing:
            out.update(
                activation_checkpointing=True,
                checkpoint_blocks=self.checkpoint_blocks,
                checkpoint_keep=self.checkpoint_keep,
            )
        return out

    def replace(self, **changes: Any) -> RunLayout:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunLayout:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, run_dir: Path) -> None:
        (Path(run_dir) / LAYOUT_FILE).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, run_dir: Path) -> Optional[RunLayout]:
        """The layout a run dir's latest attempt ran under, or None (a run from before layout.json
        existed)."""
        path = Path(run_dir) / LAYOUT_FILE
        return cls.from_json(json.loads(path.read_text())) if path.is_file() else None


LAYOUT_FILE = "layout.json"
