"""Optimizers with decay / no-decay parameter groups, and warmup + cosine / step LR schedules."""

from __future__ import annotations

import math
from bisect import bisect_right

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on norms and biases (ndim <= 1) nor on what the model lists (position embedding, class token)."""
    skip = set(getattr(model, "no_weight_decay", lambda: set())())
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 or name in skip else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(cfg, model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
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
