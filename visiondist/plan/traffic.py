"""The bytes each collective moves per optimizer step on one rank of a ViT layout
(`collective_bytes`): tensor-parallel all-reduces (or, under sequence parallelism, all-gathers and
reduce-scatters), the pipeline's sends and receives, and DDP's, FSDP's and HSDP's gradient
traffic, keyed "<mesh dim> <kind>". The time model prices them (`plan/time_model.py`) and the dry
run counts the same calls on built ranks (`verify/measure.py`)."""

from __future__ import annotations

import math

from visiondist.models.shape import ViTShape
from visiondist.plan.memory import FLOAT, RankMemory, act_size, tensor_shapes


def _padded_elements(shapes: list[tuple[int, ...]], n: int) -> int:
    """Elements of `shapes` with dim 0 padded to a multiple of `n` (what FSDP2 gathers and
    reduce-scatters)."""
    return sum(math.ceil(shape[0] / n) * n * math.prod(shape[1:]) for shape in shapes)


def collective_bytes(
    s: ViTShape,
    mem: RankMemory,
    dp: int,
    tp: int,
    pp: int,
    grad_accum: int = 1,
    precision: str = "32",
    fsdp: bool = False,
    checkpointing: bool = False,
    sequence_parallel: bool = False,
    stage_ids: tuple[int, ...] = (0,),
    n_stages: int = 1,
) -> dict[str, int]:
    """Bytes each collective kind moves per optimizer step on the rank `mem` describes, as the
    payload of each call (the full tensor an all-reduce reduces, an all-gather returns or a
    reduce-scatter takes; the tensor a send or receive carries), keyed "<mesh dim> <kind>". The
    tensors are what the code hands over: the residual stream and the gradients of fp32 tensors stay
    fp32 under autocast, the row-parallel outputs are in the autocast dtype. `checkpointing`: the
    blocks run their collectives again when they recompute (not under `checkpoint_keep=matmuls`,
    which keeps the collectives' outputs)."""
    a, t, d = act_size(precision), s.tokens, s.embed_dim
    blocks, micro = mem.detail["blocks"], mem.detail["micro_batch"]
    # micro-batches through this rank per step
    passes = grad_accum * (mem.detail["microbatches"] if pp > 1 else 1)
    # a checkpointed block runs its forward again in the backward,
    forwards = 2 if checkpointing else 1
    # up to the last tensor its backward needs: the MLP's output is not
    recomputed = 1 if checkpointing else 0
    out: dict[str, int] = {}
    if tp > 1:
        if sequence_parallel:
            rows = micro * math.ceil(t / tp) * tp * d  # token-padded to a multiple of tp
            # norm outputs in; output gradients back
            per_block_gather = (2 * FLOAT * forwards + 2 * a) * rows
            # row outputs; input gradients back
            per_block_scatter = (2 * a + recomputed * a + 2 * FLOAT) * rows
            regions = len(stage_ids)  # the token split / gather around each stage's blocks
            out["tp all_gather"] = passes * (blocks * per_block_gather + regions * 2 * FLOAT * rows)
            out["tp reduce_scatter"] = passes * blocks * per_block_scatter
            # the partial norm / bias gradients, the norm
            out["tp all_reduce"] = blocks * 6 * d * FLOAT + FLOAT
        else:
            rows = micro * t * d
            out["tp all_reduce"] = (
                passes * blocks * (2 * a + recomputed * a + 2 * FLOAT) * rows + FLOAT
            )
    if pp > 1:
        boundary = micro * t * d * FLOAT  # the residual stream, fp32
        sends = sum(int(i < n_stages - 1) + int(i > 0) for i in stage_ids)
        out["pp send"] = out["pp recv"] = passes * sends * boundary
        # the loss of each schedule step, the gradient norm
        out["pp all_reduce"] = FLOAT * (grad_accum + 1)
    shard = mem.detail.get("shard", dp)
    if dp > 1 and fsdp:
        # embedding (4 tensors), the blocks, norm and head (4): the root gathers once
        shapes = tensor_shapes(s)
        block_shapes, root_shapes = shapes[4:-4], shapes[:4] + shapes[-4:]
        gathered = a if precision in ("bf16", "16") else FLOAT  # FSDP gathers in the autocast dtype
        if shard > 1:
            out["dp all_gather"] = (
                passes
                * gathered
                * (2 * _padded_elements(block_shapes, shard) + _padded_elements(root_shapes, shard))
            )
            out["dp reduce_scatter"] = passes * FLOAT * _padded_elements(shapes, shard)
        if shard < dp:  # HSDP: each reduced gradient shard is averaged across the replicas
            out["dp all_reduce"] = passes * FLOAT * _padded_elements(shapes, shard) // shard
    elif dp > 1:
        out["dp all_reduce"] = mem.grads
    return out
