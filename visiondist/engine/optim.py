"""Optimizers with decay / no-decay parameter groups, and warmup + cosine / step LR schedules."""

from __future__ import annotations

import math
import re
from bisect import bisect_right

import torch
from torch import nn


_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
_EMBED = ("patch_embed", "cls_token", "pos_embed")


def layer_id(name: str, depth: int) -> int:
    """ViT layer of a parameter for layer-wise LR decay: 0 for the embeddings, i + 1 for block i, depth + 1 for the
    rest (final norm, head; a detector's pyramid and heads)."""
    match = _BLOCK.search(name)
    if match:
        return int(match.group(1)) + 1
    if any(part in _EMBED for part in name.split(".")):
        return 0
    return depth + 1


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float = 1.0, depth: int = 0,
                 lr: float = 1.0, decay_norm_bias: bool = False) -> list[dict]:
    """No weight decay on norms and biases (ndim <= 1) nor on what the model lists (position embedding, class token),
    unless `decay_norm_bias` (every parameter decays, as in torchvision's detection reference).

    With `layer_decay` < 1 (fine-tuning, as in BEiT / timm): one group per ViT layer and decay kind, with lr scaled by
    layer_decay ** (depth + 1 - layer). Every layer gets its groups even when this rank holds none of its parameters
    (a pipeline stage), so all ranks have the same groups."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    layers = depth + 2 if layer_decay != 1.0 else 1
    groups = [{"params": [], "weight_decay": wd, "lr": lr * (layer_decay ** (layers - 1 - layer) if layers > 1 else 1)}
              for layer in range(layers) for wd in (weight_decay, 0.0)]
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        layer = layer_id(name, depth) if layers > 1 else 0
        no_decay = not decay_norm_bias and (param.ndim <= 1 or name.rsplit(".", 1)[-1] in skip or name in skip)
        groups[2 * layer + int(no_decay)]["params"].append(param)
    return groups


def optimizer_kernels(impl: str, params) -> dict:
    """`optim.impl` as torch's optimizer arguments: one fused kernel for all parameters, one kernel per operation
    over lists of tensors (foreach), or a Python loop over tensors. `auto`: fused when every parameter is on a GPU,
    otherwise torch's own default."""
    if impl == "auto":
        params = list(params)
        impl = "fused" if params and all(p.device.type == "cuda" for p in params) else "default"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False},
            "default": {}}[impl]


def build_optimizer(cfg, model: nn.Module, depth: int = 0) -> torch.optim.Optimizer:
    """`depth`: the ViT's block count, for `optim.layer_decay`."""
    layer_decay = float(getattr(cfg, "layer_decay", 1.0))
    groups = param_groups(model, cfg.weight_decay, layer_decay, depth, cfg.lr,
                          decay_norm_bias=bool(getattr(cfg, "decay_norm_bias", False)))
    kernels = optimizer_kernels(str(getattr(cfg, "impl", "auto")), model.parameters())
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kernels)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **kernels)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def lr_factor(step: int, total_steps: int, cfg) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based) of `total_steps`."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
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


def build_scheduler(cfg, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg))
