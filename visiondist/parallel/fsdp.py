"""Fully sharded data parallelism (FSDP2 `fully_shard`) over the mesh's "dp" dim; per-block
activation checkpointing and compilation.

Each transformer block is its own FSDP unit and the root holds the rest (patch embedding, norm,
head). Parameters, gradients and optimizer state are sharded over the DP ranks (dim 0 of each
tensor, as DTensors); a block's full weights exist only while it runs, gathered just before and
freed after. With `offload` the shards, their gradients and the optimizer state live in host memory
and the optimizer steps on the CPU (FSDP2's `CPUOffloadPolicy`): the device then holds only the
gathered blocks in flight and the activations.

Parameter names are unchanged, so the optimizer's groups, checkpoints (DCP reads and writes the
DTensor shards under their global shapes, so any layout resumes from them), EMA and export work as
under DDP.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from visiondist.compat import split_mesh
from visiondist.parallel.mesh import Layout

_BLOCKS: set[type] = set()


def register_block(cls: type) -> None:
    """Modules of class `cls` are a model's transformer blocks: one FSDP unit each, the unit
    activation checkpointing recomputes and compile compiles (the model's package registers
    them)."""
    _BLOCKS.add(cls)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks (the classes `register_block` named), in module order.

    Args:
        model: the model (any wrapper included).
    """
    return [m for m in model.modules() if isinstance(m, tuple(_BLOCKS))]


CHECKPOINT_KEEPS = ("input", "matmuls")


def keep_matmuls_context():
    """torch's selective checkpointing contexts for `parallel.checkpoint_keep=matmuls`: a
    checkpointed block keeps what its matmuls, attention kernels and tensor-parallel collectives
    returned (the costly work) and recomputes the rest in the backward (norms, GELU, residual adds,
    drop path, casts: elementwise passes over memory).

    Returns:
        The (forward, recomputation) context managers torch's checkpoint takes as `context_fn`.
    """
    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    ):
        if hasattr(aten, name):
            keep.add(getattr(aten, name).default)

    def policy(_ctx, op, *args, **kwargs):
        # the TP collectives' custom ops
        saved = op in keep or str(getattr(op, "namespace", "")) == "visiondist"
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def enable_activation_checkpointing(model: nn.Module, blocks: int = -1, keep: str = "input") -> int:
    """Recompute transformer blocks' activations in the backward: all blocks, or only the first
    `blocks` (selective by block: memory for time, block by block). Each such block keeps its input
    (`keep="input"`), or also its matmuls' and attention's outputs (`"matmuls"`: selective by
    operation, torch's `create_selective_checkpoint_ contexts`; the backward recomputes only
    elementwise work). Returns the number of checkpointed blocks; a model without blocks is an
    error.

    Args:
        model: the model whose blocks recompute.
        blocks: how many blocks, from the first; -1: all.
        keep: what a recomputing block keeps: "input" or "matmuls".
    """
    if keep not in CHECKPOINT_KEEPS:
        raise ValueError(
            f"parallel.checkpoint_keep={keep!r}: use one of {', '.join(CHECKPOINT_KEEPS)}"
        )
    found = transformer_blocks(model)
    if not found:
        raise ValueError(
            f"activation checkpointing works per transformer block; {type(model).__name__} has "
            "none: drop parallel.activation_checkpointing"
        )
    chosen = found if blocks < 0 else found[:blocks]
    for block in chosen:
        # plain fields of the block's class (nn.Module types its attributes as tensors or modules)
        fields = cast(Any, block)
        fields.checkpointing = True
        if keep == "matmuls":
            fields.recompute_context = keep_matmuls_context
    return len(chosen)


def compile_mode(cuda_graphs: bool = False, autotune: bool = False) -> str | None:
    """torch.compile's mode. `cuda_graphs`: the graph replayed as CUDA graphs ("reduce-overhead");
    `autotune` (`trainer.compile_autotune`): Inductor times each matmul among cuBLAS and its own
    GEMM templates, which take the pointwise work after the matmul (bias, GELU, residual add) into
    the same kernel, and tunes the other kernels' launch settings ("max-autotune-no-cudagraphs",
    "max-autotune" with CUDA graphs). A mode is the compiled module's own: a benchmark's variants
    compile side by side, each with its own."""
    if autotune:
        return "max-autotune" if cuda_graphs else "max-autotune-no-cudagraphs"
    return "reduce-overhead" if cuda_graphs else None


def _compile_options(backend, mode: str | None) -> dict:
    return {
        **({"backend": backend} if backend is not None else {}),
        **({"mode": mode} if mode else {}),
    }


def compile_blocks(model: nn.Module, backend=None, autotune: bool = False) -> int:
    """`torch.compile` each transformer block in place (its checkpointing, if any, included). The
    blocks share one compiled graph: their parameters and buffers are graph inputs. Returns the
    number of blocks.

    Args:
        model: the model whose blocks are compiled.
        backend: torch.compile's backend; None: Inductor.
        autotune: Inductor's autotuning modes (`compile_mode`).
    """
    found = transformer_blocks(model)
    if not found:
        raise ValueError(
            f"trainer.compile compiles transformer blocks; {type(model).__name__} has none: drop it"
        )
    for block in found:
        block.compile(**_compile_options(backend, compile_mode(autotune=autotune)))
    return len(found)


def compile_model(
    model: nn.Module, cuda_graphs: bool = False, backend=None, autotune: bool = False
) -> None:
    """`torch.compile` the whole model in place (`nn.Module.compile`: its parameter names and state
    dict unchanged), one graph for all its blocks. Under DDP (wrapped after this) torch's
    DDPOptimizer cuts the graph at the gradient buckets, so their all-reduces still overlap the
    backward. `cuda_graphs`: the graph replayed as CUDA graphs (torch's CUDA graph trees); the step
    marks each iteration (`torch.compiler.cudagraph_mark_step_begin`). `autotune`:
    `compile_mode`.

    Args:
        model: the model (a DETR-class detector: its `compile_region`).
        cuda_graphs: replay the graph as CUDA graphs.
        backend: torch.compile's backend; None: Inductor.
        autotune: Inductor's autotuning modes.
    """
    options = _compile_options(backend, compile_mode(cuda_graphs, autotune))
    # a DETR: the library's network, not its loss and resizes
    region = getattr(model, "compile_region", None)
    (region() if region is not None else model).compile(**options)


def apply_fsdp(
    model: nn.Module,
    layout: Layout,
    offload: bool = False,
    param_dtype: Optional[torch.dtype] = None,
    shard_size: int = 0,
) -> nn.Module:
    """Shard `model` over the DP ranks in place: one FSDP unit per block, the root over the rest.
    With `param_dtype` (bf16 and fp16 runs) the gathered weights are in that dtype, so the
    all-gathers move half the bytes; gradients are reduced in fp32 and the shards the optimizer
    updates stay fp32. `shard_size` < dp: HSDP, sharded inside groups of that many consecutive DP
    ranks (a node's) and replicated across the groups: the gathers stay inside a group and only the
    gradient shards are all-reduced across groups."""
    mesh = layout.mesh["dp"]
    if 0 < shard_size < layout.dp:
        mesh = split_mesh(mesh, (layout.dp // shard_size, shard_size), ("dp_replicate", "dp_shard"))
    policy = (
        CPUOffloadPolicy(pin_memory=layout.device.type == "cuda") if offload else OffloadPolicy()
    )
    mixed = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None
    )
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, offload_policy=policy, mp_policy=mixed)
    fully_shard(model, mesh=mesh, offload_policy=policy, mp_policy=mixed)
    return model


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards `model` (`fully_shard` applied to it).

    Args:
        model: the model as laid out.
    """
    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Free every gathered copy of the weights (FSDP keeps the root's after a forward without
    backward), so that the next forward gathers the shards again. Needed before and after the shards
    are changed outside the optimizer (the EMA's swap).

    Args:
        model: the model as laid out (nothing happens to a model FSDP does not shard).
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank stores (a DTensor's local shard).

    Args:
        param: a parameter, plain or a DTensor.
    """
    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def forwards_needed(model: nn.Module, layout: Layout, mine: int) -> int:
    """Under FSDP every forward gathers weights from all DP ranks, so every rank must run as many
    forwards as the busiest: agree on that number before the first one (afterwards the ranks would
    be in different collectives).

    Args:
        model: the model as laid out.
        layout: this rank's `Layout`.
        mine: the forwards this rank has data for.

    Returns:
        The forwards every rank runs: the most any DP rank needs (`mine` where nothing is sharded).
    """
    if not is_fully_sharded(model) or layout.dp == 1:
        return mine
    most = torch.tensor([mine], dtype=torch.int64, device=layout.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=layout.dp_group)
    return int(most.item())


def blank_forwards(model: nn.Module, layout: Layout, count: int, autocast=None) -> None:
    """`count` forwards of one blank image (results unused): a rank whose shard ran out keeps the
    others going.

    Args:
        model: the ViT as laid out.
        layout: this rank's `Layout` (its device).
        count: how many forwards; 0 or less: none.
        autocast: the precision's autocast context; None: none.
    """
    if count <= 0:
        return
    size = cast(Any, model.patch_embed).img_size  # a ViT's (nn.Module types it Tensor | Module)
    blank = torch.zeros(1, 3, size, size, device=layout.device)
    with torch.no_grad(), autocast or nullcontext():
        for _ in range(count):
            model(blank)
