"""Training FLOPs of a classifier, counted rather than estimated: what model FLOPs utilisation (MFU) divides by."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf


def classifier_train_flops(model_cfg: DictConfig) -> float:
    """FLOPs of one forward + backward of one image at `model_cfg.img_size`, counted by `FlopCounterMode` on the model
    built on the meta device (no memory, no arithmetic): the model's FLOPs, so activation checkpointing's recompute
    does not count, as MFU defines it."""
    from torch.utils.flop_counter import FlopCounterMode

    from visiondist.models import build_model

    cfg = OmegaConf.merge(model_cfg, {"weights": None, "init_from": None})  # the run's config is read-only
    size = model_cfg.img_size
    with torch.device("meta"):
        model = build_model(cfg)
        images, labels = torch.zeros(1, 3, size, size), torch.zeros(1, dtype=torch.int64)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(images), labels).backward()
    return float(counter.get_total_flops())
