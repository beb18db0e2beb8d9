"""Memory model of a ViT (its `ViTShape`) under a (dp, tp, pp) layout: bytes per rank, before
anything is built.

Static state is counted exactly from the model's shape: parameters, gradients, optimizer state
(AdamW: two moments and a step counter per tensor; SGD with momentum: one buffer) and the EMA copy,
for the rank holding the largest pipeline stage (stages are cut exactly as
`visiondist.parallel.stages.block_ranges` cuts them). Tensor-parallel shards follow the plan in
`visiondist.parallel.tensor`: q, k, v and fc1 split by rows (weight and bias), proj and fc2 by
columns (weight only); norms, embeddings and the head are replicated.

Under FSDP each tensor is sharded along dim 0 (padded to equal chunks, as FSDP2 does) and the
gathered weights of the blocks in flight are counted as buffers; with offload the shards, gradients
and optimizer state are host memory.

Activations are an estimate: the tensors a block saves for its backward, per micro-batch in flight
(with activation checkpointing: each block's input, plus one block's full set while it is
recomputed); `plan/measured.py` measures them on a built module, and `plan/traffic.py` counts what
the collectives move.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from visiondist.config.layout import MULTI_STAGE, balance, microbatches_for, stages_per_rank_for
from visiondist.models.shape import ViTShape

FLOAT = 4  # parameters, gradients and optimizer state are fp32 whatever the autocast precision
GB = 1e9


@dataclass(frozen=True)
class Tensors:
    """Element count and tensor count of some parameters."""

    elements: int = 0
    tensors: int = 0

    def __add__(self, other: Tensors) -> Tensors:
        return Tensors(self.elements + other.elements, self.tensors + other.tensors)


def block_params(s: ViTShape, tp: int = 1) -> Tensors:
    """One transformer block's parameters on one TP rank."""
    d, h = s.embed_dim, s.hidden
    qkv = 3 * (d * d + (d if s.qkv_bias else 0)) // tp
    proj = d * d // tp + d
    fc1 = (h * d + h) // tp
    fc2 = d * h // tp + d
    norms = 4 * d
    return Tensors(qkv + proj + fc1 + fc2 + norms, (6 if s.qkv_bias else 3) + 2 + 2 + 2 + 4)


def embed_params(s: ViTShape) -> Tensors:
    d = s.embed_dim
    # conv weight + bias, cls token, pos embed
    return Tensors(3 * s.patch_size**2 * d + d + d + s.pos_tokens * d, 4)


def head_params(s: ViTShape) -> Tensors:
    d = s.embed_dim
    return Tensors(2 * d + d * s.num_classes + s.num_classes, 4)  # final norm, head


def tensor_shapes(s: ViTShape) -> list[tuple[int, ...]]:
    """Every parameter's shape, in the model's order (embedding, blocks, norm, head)."""
    d, h, t = s.embed_dim, s.hidden, s.pos_tokens
    block: list[tuple[int, ...]] = [(d,), (d,)]  # norm1
    for _ in range(3):  # q, k, v
        block += [(d, d)] + ([(d,)] if s.qkv_bias else [])
    block += [(d, d), (d,), (d,), (d,), (h, d), (h,), (d, h), (d,)]  # proj, norm2, fc1, fc2
    embed = [(d, 3, s.patch_size, s.patch_size), (d,), (1, 1, d), (1, t, d)]
    head = [(d,), (d,), (s.num_classes, d), (s.num_classes,)]
    return embed + block * s.depth + head


def fsdp_shard(s: ViTShape, n: int, rank: int = 0) -> Tensors:
    """What FSDP2 stores on `rank` of `n`: its chunk of ceil(dim0 / n) rows of every tensor (rank 0
    has the most)."""
    elements = 0
    for shape in tensor_shapes(s):
        chunk = math.ceil(shape[0] / n)
        elements += max(0, min(chunk, shape[0] - rank * chunk)) * math.prod(shape[1:])
    return Tensors(elements, len(tensor_shapes(s)))


def stage_ranges(s: ViTShape, tp: int, n_stages: int) -> list[tuple[int, int]]:
    """Blocks [first, last) of each stage, cut as `parallel.stages.block_ranges` cuts the
    (TP-sharded) model."""
    if n_stages == 1:
        return [(0, s.depth)]
    costs = [block_params(s, tp).elements] * s.depth
    costs[0] += embed_params(s).elements
    costs[-1] += head_params(s).elements
    return balance(costs, n_stages)


def stage_params(s: ViTShape, tp: int, pp: int, stages_per_rank: int = 1) -> list[Tensors]:
    """Parameters of each pipeline rank (its stages together), in rank order."""
    n = pp * stages_per_rank
    ranges = stage_ranges(s, tp, n)
    block = block_params(s, tp)
    ranks = []
    for r in range(pp):
        total = Tensors()
        for stage in range(r, n, pp):
            a, b = ranges[stage]
            total = total + Tensors(block.elements * (b - a), block.tensors * (b - a))
            if stage == 0:
                total = total + embed_params(s)
            if stage == n - 1:
                total = total + head_params(s)
        ranks.append(total)
    return ranks


def optimizer_bytes(params: Tensors, optimizer: str, momentum: float = 0.9) -> int:
    if optimizer == "adamw":
        # exp_avg, exp_avg_sq, a 0-dim step per tensor
        return 2 * FLOAT * params.elements + FLOAT * params.tensors
    if optimizer == "sgd":
        return FLOAT * params.elements if momentum else 0
    raise ValueError(f"unknown optimizer {optimizer!r}")


def act_size(precision: str) -> int:
    return 2 if str(precision) in ("bf16", "16") else 4  # autocast saves 16-bit activations


def block_activation_bytes(
    s: ViTShape, micro_batch: int, tp: int, precision: str = "32", sequence_parallel: bool = False
) -> int:
    """Tensors one block saves for its backward, for one micro-batch, as the dry run measures them:
    the two norms' inputs (fp32, the residual stream; token-sharded under SP) and statistics; the
    input of the fused q, k, v GEMM (`Attention`: one tensor, cast once under autocast) and of fc1;
    q, k, v, the attention output and its log-sum-exp (fused attention keeps no tokens x tokens
    matrix); fc1's output and the GELU's (fc2's input). The tensors inside the TP region are divided
    by tp."""
    a = act_size(precision)
    t, d, h = s.tokens, s.embed_dim, s.hidden
    sp = tp if sequence_parallel else 1
    # autocast runs norms in fp32: their inputs are fp32
    norms = (2 * t * d * FLOAT + 4 * t * FLOAT) // sp
    inputs = t * d * a + t * d * a  # the qkv GEMM's input and fc1's
    sharded = (4 * t * d * a + 2 * t * h * a + s.num_heads * t * FLOAT) // tp
    return micro_batch * (norms + inputs + sharded)


def block_matmul_bytes(
    s: ViTShape, micro_batch: int, tp: int, precision: str = "32", sequence_parallel: bool = False
) -> int:
    """What `parallel.checkpoint_keep=matmuls` keeps of one block besides its input: the matmuls'
    outputs (q, k, v and fc1 column-sharded by tp; the output projection's and fc2's partial sums,
    full size), the attention output and its log-sum-exp, and under tensor parallelism the
    collectives' outputs (the two partial sums all-reduced; under SP the two sub-blocks' gathered
    inputs, fp32, and the two reduce-scattered token slices)."""
    a = act_size(precision)
    t, d, h = s.tokens, s.embed_dim, s.hidden
    sharded = (3 * t * d * a + t * d * a + s.num_heads * t * FLOAT + t * h * a) // tp
    collectives = 0
    # the gathers' outputs are the norms' (fp32), of the tokens padded to tp
    if tp > 1 and sequence_parallel:
        padded = -(-t // tp) * tp
        collectives = 2 * padded * d * FLOAT + 2 * (padded // tp) * d * a
    elif tp > 1:
        collectives = 2 * t * d * a
    return micro_batch * (sharded + 2 * t * d * a + collectives)


def weight_copies(s: ViTShape, tp: int, blocks: int, precision: str = "32") -> int:
    """Autocast's 16-bit copies of the blocks' output projection and MLP weights, saved for the
    backward by the layers that use them (autocast casts a parameter once per forward region and
    keeps it until its backward): zero in fp32 and under FSDP, whose gathered weights are already
    16-bit. The fused q, k, v GEMM saves the weights themselves (`visiondist.models.vit._FusedQKV`):
    no copy of them is kept."""
    a = act_size(precision)
    if a == FLOAT:
        return 0
    d, h = s.embed_dim, s.hidden
    return blocks * (d * d + 2 * d * h) // tp * a


def ends_activation_bytes(
    s: ViTShape, micro_batch: int, precision: str, first: bool, last: bool, fsdp: bool = False
) -> int:
    """What the parts around the blocks save: the images (cast under autocast) for the patch
    embedding on the first stage; the final norm's input and statistics and the head's input on the
    last; autocast's weight copies."""
    a = act_size(precision)
    # autocast's 16-bit copy of the weight (FSDP gathers 16-bit)
    copy = a if a != FLOAT and not fsdp else 0
    out = 0
    if first:
        out += micro_batch * 3 * s.img_size**2 * a + copy * 3 * s.patch_size**2 * s.embed_dim
    if last:
        # the head's input is the class token of the norm's output: a view that keeps all of it in
        # fp32, a cast copy of the token alone under autocast
        head_input = s.tokens * s.embed_dim * FLOAT if a == FLOAT else s.embed_dim * a
        out += micro_batch * (s.tokens * s.embed_dim * FLOAT + 2 * s.tokens * FLOAT + head_input)
        out += copy * s.num_classes * s.embed_dim
    return out


def saved_per_microbatch(
    s: ViTShape,
    micro_batch: int,
    tp: int,
    blocks: int,
    precision: str = "32",
    checkpointing: bool = False,
    sequence_parallel: bool = False,
    first: bool = True,
    last: bool = True,
    fsdp: bool = False,
    keep: str = "input",
) -> int:
    """What one micro-batch's forward through `blocks` blocks (and the first / last stage's parts)
    leaves saved for its backward: every block's tensors and autocast's weight copies, or with
    activation checkpointing only each block's input (token-sharded under sequence parallelism), and
    with `keep="matmuls"` its matmuls' outputs."""
    ends = ends_activation_bytes(s, micro_batch, precision, first, last, fsdp)
    residual = residual_size(precision, fsdp)
    if checkpointing:
        kept = micro_batch * s.tokens * s.embed_dim * residual // (tp if sequence_parallel else 1)
        if keep == "matmuls":
            kept += block_matmul_bytes(s, micro_batch, tp, precision, sequence_parallel)
        return blocks * kept + ends
    copies = 0 if fsdp else weight_copies(s, tp, blocks, precision)
    return (
        blocks * block_activation_bytes(s, micro_batch, tp, precision, sequence_parallel)
        + copies
        + ends
    )


def residual_size(precision: str, fsdp: bool = False) -> int:
    """Bytes per element of the residual stream between blocks: fp32, except under FSDP with a
    16-bit parameter dtype, which casts each block's input to it."""
    return act_size(precision) if fsdp else FLOAT


def microbatches_in_flight(schedule: str, pp: int, microbatches: int) -> int:
    """Micro-batches whose activations the first pipeline rank holds at its peak."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return microbatches
    return min(microbatches, pp + (pp if schedule in MULTI_STAGE else 0))


@dataclass
class RankMemory:
    """Bytes on one rank. `device` is what the accelerator must hold; offloaded state is in `host`
    instead."""

    params: int
    grads: int
    optimizer: int
    ema: int
    activations: int
    # DDP's gradient buckets / the flat all-reduce copy; FSDP's gathered blocks in flight
    buffers: int = 0
    offloaded: bool = False
    detail: dict = field(default_factory=dict)

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer + self.ema

    @property
    def device(self) -> int:
        return (0 if self.offloaded else self.state) + self.activations + self.buffers

    @property
    def host(self) -> int:
        return self.state if self.offloaded else 0

    @property
    def total(self) -> int:
        return self.state + self.activations + self.buffers


def rank_memory(
    s: ViTShape,
    dp: int,
    tp: int,
    pp: int,
    global_batch: int,
    grad_accum: int = 1,
    optimizer: str = "adamw",
    ema: bool = False,
    precision: str = "32",
    schedule: str = "1f1b",
    stages_per_rank: int = -1,
    microbatches: int = -1,
    pp_rank: Optional[int] = None,
    fsdp: bool = False,
    offload: bool = False,
    checkpointing: bool = False,
    sequence_parallel: bool = False,
    dp_rank: int = 0,
    shard_size: int = 0,
    keep: str = "input",
) -> RankMemory:
    """Bytes on the busiest rank (or on `pp_rank`'s ranks; under FSDP on `dp_rank`, default the
    first, which holds the most) of the layout. `shard_size` < dp under FSDP: HSDP, sharded inside
    groups of that many DP ranks."""
    spr = stages_per_rank_for(schedule, stages_per_rank) if pp > 1 else 1
    m = microbatches_for(pp, microbatches) if pp > 1 else grad_accum
    per_rank = stage_params(s, tp, pp, spr)
    rank = max(range(pp), key=lambda r: per_rank[r].elements) if pp_rank is None else pp_rank
    shard = shard_size or dp
    params = fsdp_shard(s, shard, dp_rank % shard) if fsdp else per_rank[rank]
    local_batch = global_batch // dp
    micro = local_batch // (grad_accum * (m if pp > 1 else 1))
    ranges = stage_ranges(s, tp, pp * spr)
    blocks = sum(b - a for stage, (a, b) in enumerate(ranges) if stage % pp == rank)
    in_flight = microbatches_in_flight(schedule, pp, m)
    # looped placement: stage 0 on rank 0, the last on rank pp - 1
    first, last = rank == 0, rank == pp - 1
    one = saved_per_microbatch(
        s, micro, tp, blocks, precision, checkpointing, sequence_parallel, first, last, fsdp, keep
    )
    copies = 0 if fsdp or checkpointing else weight_copies(s, tp, blocks, precision)
    # autocast's weight copies are made once per step, not per micro-batch
    act = in_flight * (one - copies) + copies
    if checkpointing:  # and one block's full set (and weight copies) while it is recomputed
        act += block_activation_bytes(s, micro, tp, precision, sequence_parallel) + (
            0 if fsdp else weight_copies(s, tp, 1, precision)
        )
    block = block_params(s, tp).elements
    # two blocks gathered (the running one and the prefetched next), one block's full gradient, the
    # root
    if fsdp:
        root = embed_params(s).elements + head_params(s).elements
        buffers = FLOAT * (3 * block + 2 * root)
    elif dp > 1:  # DDP's buckets, or the pipeline's flat all-reduce: a copy of the gradients
        buffers = FLOAT * params.elements
    else:
        buffers = 0
    return RankMemory(
        params=FLOAT * params.elements,
        grads=FLOAT * params.elements,
        optimizer=optimizer_bytes(params, optimizer),
        ema=FLOAT * params.elements if ema else 0,
        activations=act,
        buffers=buffers,
        offloaded=offload,
        detail={
            "rank": rank,
            "blocks": blocks,
            "micro_batch": micro,
            "in_flight": in_flight,
            "param_tensors": params.tensors,
            "microbatches": m,
            "shard": shard,
        },
    )
