"""The hardware a plan is made for, one candidate layout (mesh, sharding, memory levers), and the
time model that ranks candidates: `step_seconds`, FLOPs (`visiondist.models.flops.vit_train_flops`)
over the device's rate (lower for matmuls of few rows, i.e. small micro-batches), with the pipeline
bubble and what checkpointing recomputes, plus each collective's bytes over the link it crosses
(NVLink-class inside a node, network between nodes, PCIe to the host), less what overlaps with
compute. The model ranks layouts; it does not predict wall time. The search over candidates is
`visiondist.plan.planner`; one layout's levers, `visiondist.plan.fit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from visiondist.models.flops import vit_train_flops
from visiondist.models.shape import ViTShape
from visiondist.plan.memory import GB, RankMemory
from visiondist.plan.traffic import collective_bytes

HOST_MEMORY_GBS = 50.0  # host memory bandwidth for the offloaded (CPU) optimizer step
# a matmul with this many rows (tokens of a micro-batch) runs at half the device's rate
GEMM_HALF_ROWS = 512
# What `checkpoint_keep=matmuls` recomputes, as a fraction of the step: the forward's elementwise
# work (norms, GELU, residual adds). ViT-H/14's compiled bf16 step on an H100 spent 32% in fused
# elementwise and norm kernels, forward and backward (benchmarks/RESULTS.md); the forward's share of
# that is about a third.
ELEMENTWISE_RECOMPUTE = 0.11
# An fp32 step's matmuls run in TF32 (trainer.tf32, on by default) at half the dense bf16 rate of
# an A100, H100 or H200 tensor core; `Hardware.tflops` (parallel.device_tflops) is the bf16 rate.
# Where the devices are the host's CPUs, the rate given is already the run's precision's.
TF32_SHARE = 0.5


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
    rate = hw.tflops * 1e12 * (TF32_SHARE if precision == "32" and not hw.shared_host else 1.0)
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
