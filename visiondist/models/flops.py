"""Training FLOPs of a model per image: what model FLOPs utilisation (MFU) divides by and what the
planner's time model runs at the device's rate. `classifier_train_flops` counts them on the model
itself (any classifier); `vit_train_flops` is the same count written out for a ViT's shape
(`visiondist.models.shape.ViTShape`), without torch, for planning before anything is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import OmegaConf

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from visiondist.models.shape import ViTShape


def classifier_train_flops(model_cfg: DictConfig) -> float:
    """FLOPs of one forward + backward of one image at `model_cfg.img_size`, counted by
    `FlopCounterMode` on the model built on the meta device (no memory, no arithmetic): the model's
    FLOPs, so activation checkpointing's recompute does not count, as MFU defines it."""
    # torch (2 s) and the model builders where a model is counted: the planner reads this module
    # in the launching process, which imports no torch
    import torch  # noqa: PLC0415 (torch: see above)
    import torch.nn.functional as F  # noqa: PLC0415 (torch: see above)
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415 (torch: see above)

    from visiondist.models import build_model  # noqa: PLC0415 (torch: see above)

    # the run's config is read-only
    cfg = OmegaConf.merge(model_cfg, {"weights": None, "init_from": None})
    size = model_cfg.img_size
    with torch.device("meta"):
        model = build_model(cfg)
        images, labels = torch.zeros(1, 3, size, size), torch.zeros(1, dtype=torch.int64)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(images), labels).backward()
    return float(counter.get_total_flops())


def vit_train_flops(s: ViTShape, checkpointing: bool = False) -> float:
    """Forward + backward matmul FLOPs of one image of a ViT of shape `s`, as
    `torch.utils.flop_counter` counts them: each block's and the head's backward costs 2 x their
    forward (input and weight gradients), the patch embedding's 1 x (the images need no gradient);
    activation checkpointing runs the blocks' forward once more."""
    t, d, h = s.tokens, s.embed_dim, s.hidden
    block = 2 * t * (4 * d * d + 2 * d * h) + 4 * t * t * d
    patch = 2 * (t - 1) * 3 * s.patch_size**2 * d
    head = 2 * d * s.num_classes
    return s.depth * block * (4 if checkpointing else 3) + 2 * patch + 3 * head
