"""Optimizers with decay / no-decay parameter groups, and warmup + cosine / step LR schedules."""

from __future__ import annotations

import logging
import math
import re
from bisect import bisect_right
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import (
    _get_foreach_kernels_supported_devices,
    _get_fused_kernels_supported_devices,
)

log = logging.getLogger(__name__)

_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
_EMBED = ("patch_embed", "cls_token", "pos_embed")


def layer_id(name: str, depth: int) -> int:
    """ViT layer of a parameter for layer-wise LR decay: 0 for the embeddings, i + 1 for block i,
    depth + 1 for the rest (final norm, head; a detector's pyramid and heads)."""
    match = _BLOCK.search(name)
    if match:
        return int(match.group(1)) + 1
    if any(part in _EMBED for part in name.split(".")):
        return 0
    return depth + 1


def param_groups(
    model: nn.Module,
    weight_decay: float,
    layer_decay: float = 1.0,
    depth: int = 0,
    lr: float = 1.0,
    decay_norm_bias: bool = False,
) -> list[dict]:
    """No weight decay on norms and biases (ndim <= 1) nor on what the model lists (position
    embedding, class token), unless `decay_norm_bias` (every parameter decays, as in torchvision's
    detection reference).

    With `layer_decay` < 1 (fine-tuning, as in BEiT / timm): one group per ViT layer and decay kind,
    with lr scaled by layer_decay ** (depth + 1 - layer). Every layer gets its groups even when this
    rank holds none of its parameters (a pipeline stage), so all ranks have the same groups."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    layers = depth + 2 if layer_decay != 1.0 else 1
    groups: list[dict[str, Any]] = [
        {
            "params": [],
            "weight_decay": wd,
            "lr": lr * (layer_decay ** (layers - 1 - layer) if layers > 1 else 1),
        }
        for layer in range(layers)
        for wd in (weight_decay, 0.0)
    ]
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        layer = layer_id(name, depth) if layers > 1 else 0
        no_decay = not decay_norm_bias and (
            param.ndim <= 1 or name.rsplit(".", 1)[-1] in skip or name in skip
        )
        groups[2 * layer + int(no_decay)]["params"].append(param)
    return groups


# Kernels measured on 2 CPU cores (torch 2.15, one AdamW step of the ViT's parameters;
# benchmarks/RESULTS.md): ViT-S (21.7M) fused 12 ms, foreach 66 ms, loop 74 ms; ViT-Ti (5.5M) fused
# 4.5 ms, foreach 22 ms, loop 11 ms.
KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}


def resolve_impl(impl: str, name: str, params) -> str:
    """`optim.impl` as the kernel torch will run: `fused` (one kernel for all tensors), `foreach`
    (one kernel per operation over lists of tensors) or `loop` (a Python loop over tensors). `auto`
    is the fastest torch offers where the parameters live: fused wherever torch has it (CUDA, and
    the CPU since torch 2.4, pytorch/pytorch#123074; there AdamW's step is 2-6x faster than the
    others), except SGD on DTensors (FSDP), which DTensor has no sharding rule for; then foreach on
    devices with foreach kernels (CUDA), else the loop (on the CPU foreach is the slowest)."""
    if impl != "auto":
        return impl
    params = list(params)
    sharded = [isinstance(p, DTensor) for p in params]
    # lists mixing Tensor and DTensor break fused and foreach kernels alike
    if any(sharded) and not all(sharded):
        return "loop"
    devices = {p.device.type for p in params}
    fused_ok = not (name == "sgd" and any(sharded)) and all(p.is_floating_point() for p in params)
    if params and fused_ok and devices <= set(_get_fused_kernels_supported_devices()):
        return "fused"
    return (
        "foreach" if params and devices <= set(_get_foreach_kernels_supported_devices()) else "loop"
    )


def describe_optimizer(optimizer: torch.optim.Optimizer, impl: str) -> str:
    """E.g. "adamw (auto: fused)": the optimizer and the kernel it runs, read back from its
    defaults."""
    d = optimizer.defaults
    kernel = "fused" if d.get("fused") else "foreach" if d.get("foreach") else "loop"
    name = type(optimizer).__name__.lower()
    return f"{name} ({impl}: {kernel})" if impl == "auto" else f"{name} ({kernel})"


def build_optimizer(cfg, model: nn.Module, depth: int = 0) -> torch.optim.Optimizer:
    """`depth`: the ViT's block count, for `optim.layer_decay`."""
    layer_decay = float(getattr(cfg, "layer_decay", 1.0))
    groups = param_groups(
        model,
        cfg.weight_decay,
        layer_decay,
        depth,
        cfg.lr,
        decay_norm_bias=bool(getattr(cfg, "decay_norm_bias", False)),
    )
    impl = str(getattr(cfg, "impl", "auto"))
    kernels = KERNELS[resolve_impl(impl, cfg.name, model.parameters())]
    optimizer: torch.optim.Optimizer
    if cfg.name == "adamw":
        optimizer = torch.optim.AdamW(
            groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kernels
        )
    elif cfg.name == "sgd":
        optimizer = torch.optim.SGD(
            groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **kernels
        )
    else:
        raise ValueError(f"unknown optimizer {cfg.name!r}")
    decay = f", layer decay {layer_decay:g}" if layer_decay != 1.0 else ""
    log.info(
        "optimizer: %s, peak lr %g, weight decay %g%s",
        describe_optimizer(optimizer, impl),
        cfg.lr,
        cfg.weight_decay,
        decay,
    )
    return optimizer


def warmup_length(cfg, total_steps: int) -> int:
    """The steps of warmup a run of `total_steps` gets: `schedule.warmup_steps`, cut to leave the
    last step out; -1 (the schedules' default): a fifth of the run, at most
    `schedule.warmup_auto_max` (the default run's 279 steps get the whole 30; a 6-step example
    1)."""
    if cfg.warmup_steps < 0:
        return min(int(getattr(cfg, "warmup_auto_max", 30)), total_steps // 5)
    return min(cfg.warmup_steps, max(total_steps - 1, 0))


def lr_factor(step: int, total_steps: int, cfg) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based) of `total_steps`."""
    warmup = warmup_length(cfg, total_steps)
    if step < warmup:
        return cfg.warmup_start_factor + (1 - cfg.warmup_start_factor) * step / warmup
    if cfg.name == "cosine":
        span = max(total_steps - 1 - warmup, 1)
        progress = min((step - warmup) / span, 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.name == "step":
        boundaries = sorted(round(m * total_steps) for m in cfg.milestones)
        return cfg.gamma ** bisect_right(boundaries, step)
    raise ValueError(f"unknown schedule {cfg.name!r}")


def build_scheduler(
    cfg, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, cfg)
    )
