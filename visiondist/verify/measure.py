"""One rank of the dry run, measured and planned: the rank built by the training code on the fake
group (meta device; FSDP on fake tensors), one training step, and the bytes read off the built
objects (parameters, gradients, optimizer state, what autograd saves for one micro-batch, the
start-up peak), beside the planner's figures for the same coordinate."""

from __future__ import annotations

import inspect
import math
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from visiondist.bench.measure import synthetic_batch
from visiondist.config.layout import RunLayout
from visiondist.engine.optim import build_optimizer
from visiondist.engine.precision import autocast_dtype
from visiondist.models import build_deferred, build_model
from visiondist.models.shape import ViTShape
from visiondist.parallel import (
    Layout,
    PipelinedViT,
    PipelineSpec,
    average_over_data_parallel,
    build_layout,
    clip_grad_norm,
    finish_gradients,
    parallelize,
)
from visiondist.parallel.grad import mean_over_group
from visiondist.parallel.stages import stage_indices
from visiondist.parallel.tensor import SHARD_DIM
from visiondist.plan.measured import module_state, saved_storages
from visiondist.plan.memory import FLOAT, saved_per_microbatch, tensor_shapes
from visiondist.plan.resolve import layout_memory
from visiondist.plan.traffic import collective_bytes
from visiondist.verify.world import AsOnDevice, Traffic, fake_world, nbytes

# torch 2.14+: tensors selective checkpointing keeps can pass through saved-tensor hooks, which the
# measurement is; on older torch they bypass them and a `checkpoint_keep=matmuls` layout's
# activations are measured short
_SAC_HOOKS = (
    "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters
)


def _emulating(saved, emulate):
    """A checkpointed block's `recompute_context` that recomputes as the forward ran on the emulated
    device (autocast and fused attention as there), around the block's own contexts
    (`parallel.checkpoint_keep=matmuls`) if any."""

    @contextmanager
    def both(inner):
        with ExitStack() as stack:
            stack.enter_context(inner)
            stack.enter_context(AsOnDevice(*emulate))
            yield

    def contexts():
        forward, recompute = saved() if saved is not None else (nullcontext(), nullcontext())
        return forward, both(recompute)

    return contexts


def _local_bytes(tensors) -> int:
    return sum(nbytes(t) for t in tensors if t is not None)


def _optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        _local_bytes(v for v in state.values() if isinstance(v, torch.Tensor))
        for state in optimizer.state.values()
    )


def _images(cfg: DictConfig, n: int, device: str) -> torch.Tensor:
    size = int(cfg.model.img_size)
    return torch.zeros(n, 3, size, size, device=device)


def measure_detector_rank(
    cfg: DictConfig, run: RunLayout, rank: int
) -> tuple[tuple[int, int, int], dict, dict]:
    """A detector's rank (DDP): the model built as training builds it (on the CPU: torchvision's
    detectors need real values to sample boxes), one real forward and backward of a synthetic
    micro-batch at the configured size, the DP reduction over the fake group, the optimizer step."""
    with fake_world(rank, run.world_size):
        layout = build_layout(
            run.dp, run.tp, run.pp, torch.device("cpu"), rank % run.per_node, run=run
        )
        model, _ = build_deferred(cfg.model, weights=False)
        model = parallelize(model, layout, wrap=False).train()
        accum = int(cfg.trainer.grad_accum)
        micro = int(cfg.data.batch_size) // run.dp // accum
        images, targets = synthetic_batch(cfg, "detection", micro, torch.device("cpu"), seed=rank)
        images = [image.float() / 255 for image in images]
        traffic = Traffic({id(layout.dp_group): "dp"})
        with traffic:
            for i in range(accum):
                if i == 0:
                    with saved_storages(model) as saved:
                        losses = model(images, targets)
                else:
                    losses = model(images, targets)
                (sum(loss.float() for loss in losses.values()) / accum).backward()
            params = list(model.parameters())
            if run.dp > 1:  # what DDP's reducer does, in the same 25 MB buckets
                mean_over_group(
                    [p.grad for p in params if p.grad is not None], layout.dp_group, layout.dp
                )
            clip_grad_norm(params, float(cfg.trainer.clip_grad), layout)
            optimizer = build_optimizer(cfg.optim, model)
            optimizer.step()
        figures = {
            "parameters": _local_bytes(params),
            "gradients": _local_bytes(p.grad for p in params),
            "optimizer": _optimizer_bytes(optimizer),
            "activations": saved["bytes"],
        }
        return _coordinate(layout), figures, traffic.bytes


def _coordinate(layout: Layout) -> tuple[int, int, int]:
    """The rank's (pp, dp, tp) coordinate in its mesh."""
    coordinate = layout.mesh.get_coordinate()
    if coordinate is None:  # every rank of the job is in its mesh
        raise RuntimeError("this rank is not in the device mesh")
    pp, dp, tp = coordinate
    return pp, dp, tp


def planned_detector(cfg: DictConfig, run: RunLayout) -> tuple[dict, dict]:
    """The plan of a detector's rank: its state counted from the model built on the meta device
    (activations are not modelled for detectors: the dry run reports them measured only)."""
    with torch.device("meta"):
        model = build_model(OmegaConf.merge(cfg.model, {"weights": None, "init_from": None}))
    mem = module_state(model, str(cfg.optim.name), float(getattr(cfg.optim, "momentum", 0.9)))
    figures = {
        "parameters": mem.params,
        "gradients": mem.grads,
        "optimizer": mem.optimizer,
        "activations": None,
    }
    return figures, ({"dp all_reduce": mem.grads} if run.dp > 1 else {})


def measure_rank(
    cfg: DictConfig, run: RunLayout, rank: int
) -> tuple[tuple[int, int, int], dict, dict]:
    """Build `rank` of `run` with the training code on a fake process group and run one step: its
    coordinate, its bytes by component, and its collective bytes per step."""
    with fake_world(rank, run.world_size):
        layout = build_layout(
            run.dp, run.tp, run.pp, torch.device("cpu"), rank % run.per_node, run=run
        )
        device = "cpu" if run.fsdp else "meta"  # FSDP2 steps only materialised (here: fake) tensors
        layout = replace(layout, device=torch.device(device))
        model, _ = build_deferred(cfg.model, weights=False)
        model = parallelize(
            model,
            layout,
            run.sequence_parallel,
            PipelineSpec.from_layout(run),
            fsdp=run.fsdp,
            shard_size=run.shard_size,
            offload=run.offload,
            activation_checkpointing=run.activation_checkpointing,
            checkpoint_blocks=run.checkpoint_blocks,
            checkpoint_keep=run.checkpoint_keep,
            param_dtype=autocast_dtype(cfg.trainer.precision),
            wrap=False,
        )
        fake = FakeTensorMode(allow_non_fake_inputs=True) if run.fsdp else nullcontext()
        emulate = (autocast_dtype(cfg.trainer.precision), str(cfg.model.sdpa) != "math")
        autocast = AsOnDevice(*emulate)
        # a checkpointed block recomputes (on autograd's thread) as it ran forward
        for module in model.modules():
            if getattr(module, "checkpointing", False):
                # plain fields of the block's class (nn.Module types its attributes as tensors or
                # modules)
                block = cast(Any, module)
                # keep=matmuls: count what it keeps
                if block.recompute_context is not None and _SAC_HOOKS:
                    block.checkpoint_options = {"respect_saved_tensors_hooks": True}
                block.recompute_context = _emulating(block.recompute_context, emulate)
        groups = {id(layout.mesh.get_group(dim)): dim for dim in ("pp", "dp", "tp")}
        with fake:
            if run.fsdp:
                model.to_empty(device="cpu")
            local = int(cfg.data.batch_size) // run.dp
            accum = int(cfg.trainer.grad_accum)
            micro = local // accum // (run.microbatches if run.pp > 1 else 1)
            with autocast:
                activations = _saved_one_microbatch(model, cfg, micro, device)
            # the stages' outputs as the step computes them (autocast)
            if isinstance(model, PipelinedViT):
                with autocast:
                    model.use_static_shapes(_images(cfg, micro, device))
            # HSDP's groups are FSDP's own
            traffic = Traffic(groups, other="dp" if run.fsdp else "world")
            # the backward too: recomputed blocks must see what their forward saw
            with traffic, autocast:
                _train_step(model, layout, cfg, run, local // accum, device)
                optimizer = build_optimizer(cfg.optim, model, int(cfg.model.depth))
                optimizer.step()
            params = list(model.parameters())
            figures = {
                "parameters": _local_bytes(params),
                "gradients": _local_bytes(p.grad for p in params),
                "optimizer": _optimizer_bytes(optimizer),
                "activations": activations,
            }
            figures["start-up"] = figures["parameters"] + max(
                FLOAT * _full_numel(p, run.tp) for p in params
            )
        return _coordinate(layout), figures, traffic.bytes


def _full_numel(param: torch.Tensor, tp: int) -> int:
    """Elements of the full tensor a rank draws to cut `param` from (a DTensor's shape is already
    the full one)."""
    return param.numel() * (tp if getattr(param, SHARD_DIM, None) is not None else 1)


def _saved_one_microbatch(model: nn.Module, cfg: DictConfig, micro: int, device: str) -> int:
    """Bytes saved for the backward of one micro-batch's forward through this rank's stages (or
    whole model)."""
    if isinstance(model, PipelinedViT):
        images = _images(cfg, micro, device)
        enter = model._enter
        if enter is None:  # a model built on the meta device keeps it: the dry run's is
            raise ValueError("the dry run measures a pipeline built on the meta device")
        boundary = enter(images).detach().requires_grad_(True)
        # kept until the end: a freed graph's storages would be reused and counted once
        outputs = []
        with saved_storages(model) as saved:
            for stage, index in zip(model._stages, model.stage_ids):
                outputs.append(stage(images if index == 0 else boundary))
        return saved["bytes"]
    with saved_storages(model) as saved:
        model(_images(cfg, micro, device))
    return saved["bytes"]


def _train_step(
    model: nn.Module, layout, cfg: DictConfig, run: RunLayout, batch: int, device: str
) -> None:
    """What `OptimizerStep.train_step` does to the gradients, with zeros for data: every
    accumulation step's forward and backward (or pipeline step), TP's partial gradients, the DP
    average, the global-norm clip."""
    accum = int(cfg.trainer.grad_accum)
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    for _ in range(accum):
        if isinstance(model, PipelinedViT):
            model.train_step(
                _images(cfg, batch, device) if model.is_first else None,
                labels if model.is_last else None,
                1.0 / accum,
            )
        else:
            (F.cross_entropy(model(_images(cfg, batch, device)).float(), labels) / accum).backward()
    params = list(model.parameters())
    finish_gradients(params, layout)
    if isinstance(model, PipelinedViT):
        average_over_data_parallel(params, layout)
    elif run.dp > 1 and not run.fsdp:  # what DDP's reducer does, in the same 25 MB buckets
        mean_over_group([p.grad for p in params if p.grad is not None], layout.dp_group, layout.dp)
    clip_grad_norm(params, float(cfg.trainer.clip_grad), layout)


# -- the plan's figures ----------------------------------------------------------------------------


def planned_rank(
    cfg: DictConfig, shape: ViTShape, run: RunLayout, coordinate: tuple[int, int, int]
) -> tuple[dict, dict]:
    """The planner's bytes by component and collective bytes for the rank at `coordinate`, for one
    micro-batch's saved activations."""
    pp_rank, dp_rank, _ = coordinate
    t = cfg.trainer
    mem = layout_memory(cfg, run, pp_rank, dp_rank)
    blocks = mem.detail["blocks"]
    figures = {
        "parameters": mem.params,
        "gradients": mem.grads,
        "optimizer": mem.optimizer,
        "activations": saved_per_microbatch(
            shape,
            mem.detail["micro_batch"],
            run.tp,
            blocks,
            str(t.precision),
            run.activation_checkpointing,
            run.sequence_parallel,
            pp_rank == 0,
            pp_rank == run.pp - 1,
            run.fsdp,
            run.checkpoint_keep,
        ),
        "start-up": mem.params + FLOAT * max(math.prod(x) for x in tensor_shapes(shape)),
    }
    stages = tuple(stage_indices(pp_rank, run.pp, run.stages_per_rank)) if run.pp > 1 else (0,)
    # matmuls: kept
    recompute_collectives = run.activation_checkpointing and run.checkpoint_keep == "input"
    traffic = collective_bytes(
        shape,
        mem,
        run.dp,
        run.tp,
        run.pp,
        int(t.grad_accum),
        str(t.precision),
        run.fsdp,
        recompute_collectives,
        run.sequence_parallel,
        stages,
        run.pp * run.stages_per_rank,
    )
    return figures, traffic
