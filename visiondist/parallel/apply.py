"""`parallelize`: a finished single-device model laid out over the device mesh (tensor-parallel plan
-> pipeline stages -> data parallel or FSDP), and `local_part`: which part of each full tensor a
rank holds."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from visiondist.parallel.data import wrap_data_parallel
from visiondist.parallel.fsdp import (
    apply_fsdp,
    compile_blocks,
    compile_model,
    enable_activation_checkpointing,
)
from visiondist.parallel.mesh import Layout
from visiondist.parallel.pipeline import PipelinedViT, PipelineSpec
from visiondist.parallel.tensor import SHARD_DIM, apply_tensor_parallel


def parallelize(
    model: nn.Module,
    layout: Layout,
    sequence_parallel: bool = False,
    pipeline: Optional[PipelineSpec] = None,
    loss_fn: Optional[Callable] = None,
    fsdp: bool = False,
    offload: bool = False,
    activation_checkpointing: bool = False,
    checkpoint_blocks: int = -1,
    checkpoint_keep: str = "input",
    compile: bool | str = False,
    param_dtype: Optional[torch.dtype] = None,
    materialize: Optional[Callable[[nn.Module], None]] = None,
    wrap: bool = True,
    shard_size: int = 0,
    cuda_graphs: bool = False,
    compile_autotune: bool = False,
) -> nn.Module:
    """Lay `model` (already on `layout.device`, with the same initial weights on every rank) out
    over the mesh.

    A model on the meta device is laid out first and then handed to `materialize`, before any
    wrapper that needs real tensors (DDP broadcasts them): it allocates and fills this rank's
    tensors (`local_part` says which part of each full tensor that is).

    With `layout.pp > 1` the result is this rank's `PipelinedViT` (its stages, TP-sharded inside
    when tp > 1); its gradients are averaged over data parallel by `average_over_data_parallel`
    after the schedule's backward, as Megatron does, instead of by a DDP wrapper; its last stage
    computes `loss_fn(logits, labels)` (default: cross entropy). With `fsdp` it is the model fully
    sharded over DP (FSDP2; `offload` keeps the shards in host memory). `param_dtype` (bf16, fp16
    runs): FSDP gathers the weights in that dtype; `shard_size` < dp: HSDP (shard inside groups of
    that many DP ranks, replicate across them). Otherwise it is the model, under DDP when dp > 1
    (`wrap=False`: bare, for the dry run, whose meta tensors DDP cannot broadcast).
    `activation_checkpointing` recomputes each block's activations in the backward
    (`checkpoint_blocks` > 0: only the first that many blocks; `checkpoint_keep="matmuls"`: each
    keeps its matmuls' outputs too), under any layout; `compile` ("blocks" or True) compiles each
    block (before any sharding wrapper, as FSDP2 expects), "model" the whole model (one device or
    DDP only), replayed as CUDA graphs with `cuda_graphs`; `compile_autotune`: Inductor's autotuning
    modes (`fsdp.compile_mode`).

    Args:
        model: the finished single-device model (on `layout.device`, or on the meta device).
        layout: this rank's `Layout` (the mesh and its degrees).
        sequence_parallel: Megatron-SP inside the tensor-parallel groups (needs tp > 1).
        pipeline: the pipeline's schedule and micro-batches (pp > 1); None: `PipelineSpec.of(pp)`.
        loss_fn: the last pipeline stage's loss; None: cross entropy.
        fsdp: shard over the DP ranks (FSDP2) instead of DDP.
        offload: with `fsdp`, the shards and the optimizer state in host memory.
        activation_checkpointing: recompute the blocks' activations in the backward.
        checkpoint_blocks: how many blocks recompute, from the first; -1: all.
        checkpoint_keep: what a recomputing block keeps: "input" or "matmuls".
        compile: torch.compile: False, True or "blocks" (each block), "model" (the whole model).
        param_dtype: FSDP's gather dtype (bf16, fp16 runs); None: the parameters' own.
        materialize: allocates and fills a meta model's tensors once it is laid out; None: nothing.
        wrap: put a data-parallel model under DDP; False: bare (the dry run).
        shard_size: FSDP's shard group size: 0 every DP rank; fewer than dp: HSDP.
        cuda_graphs: replay the whole compiled model as CUDA graphs.
        compile_autotune: Inductor's autotuning modes.

    Returns:
        The laid-out model: under DDP, FSDP2, a `PipelinedViT`, or the model itself.

    Raises:
        ValueError: a combination this layout cannot run (FSDP with tp or pp, a whole-model compile
            under a sharded layout, pipeline stages of a model that is not a ViT classifier).
    """
    if activation_checkpointing:
        enable_activation_checkpointing(model, checkpoint_blocks, checkpoint_keep)
    if compile == "model":
        if fsdp or layout.tp > 1 or layout.pp > 1:
            raise ValueError(
                "compile='model' compiles a model whole on each rank (one device or DDP): use "
                "compile='blocks' with tensor or pipeline parallelism or FSDP"
            )
        compile_model(model, cuda_graphs, autotune=compile_autotune)
    elif compile:
        compile_blocks(model, autotune=compile_autotune)
    materialize = materialize or (lambda _model: None)
    if fsdp:
        if layout.tp > 1 or layout.pp > 1:
            raise ValueError(
                "FSDP shards over data parallel only here: use tp=1 and pp=1 with fsdp"
            )
        model = apply_fsdp(model, layout, offload, param_dtype, shard_size)
        materialize(model)
        return model
    if layout.tp > 1:
        model = apply_tensor_parallel(model, layout.tp_communicator(), sequence_parallel)
    if layout.pp > 1:
        if (
            not hasattr(model, "blocks")
            or not hasattr(model, "patch_embed")
            or not hasattr(model, "head")
        ):
            raise ValueError(
                f"pipeline parallelism cuts a ViT classifier into stages of blocks; "
                f"{type(model).__name__} is not one: use parallel.pp=1"
            )
        kwargs = {"loss_fn": loss_fn} if loss_fn is not None else {}
        model = PipelinedViT(
            model,
            layout,
            pipeline or PipelineSpec.of(layout.pp),
            sequence_parallel=sequence_parallel,
            **kwargs,
        )
        materialize(model)
        return model
    materialize(model)
    return wrap_data_parallel(model, layout) if wrap else model


def local_part(layout: Layout) -> Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]:
    """(name, this rank's parameter, the parameter's full value) -> the part this rank holds: the
    tensor-parallel shard along the dim the plan cut, the DTensor's local shard (FSDP: `torch.chunk`
    along each sharded dim, as DTensor cuts), or all of it (replicated, or a pipeline stage's
    own).

    Args:
        layout: this rank's `Layout`.

    Returns:
        The function `(name, parameter, full value) -> this rank's part`, what `materialize`
        fills each parameter with.
    """

    def part(name: str, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        if isinstance(param, DTensor):
            coordinate = param.device_mesh.get_coordinate()
            if coordinate is None:  # a parameter's mesh holds every rank of its layout
                raise ValueError(f"{name}: this rank is not in its device mesh")
            for mesh_dim, placement in enumerate(param.placements):
                if isinstance(placement, Shard):
                    chunks = full.chunk(param.device_mesh.size(mesh_dim), dim=placement.dim)
                    index = coordinate[mesh_dim]
                    full = (
                        chunks[index] if index < len(chunks) else full.narrow(placement.dim, 0, 0)
                    )
            return full
        dim = getattr(param, SHARD_DIM, None)
        if dim is not None and layout.tp_comm is not None:
            return full.chunk(layout.tp_comm.size, dim=dim)[layout.tp_comm.rank]
        return full

    return part
