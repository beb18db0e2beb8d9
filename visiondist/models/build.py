"""The model registry's builders: `build_model(cfg.model)` (a plain `nn.Module` of a family: ViT,
torchvision detector, ViTDet), `build_deferred` (a ViT on the meta device and the source of its
initial values), and what each family is trained for and evaluated by (`TASKS`, `EVAL_METRICS`,
`eval_metrics`, defined in `registry.py`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from omegaconf import OmegaConf
from torch import nn

from visiondist.models.detr_library import build_detr
from visiondist.models.init import InitSource, materialize

# re-exported (the package's lazy exports read them from registry.py)
from visiondist.models.registry import EVAL_METRICS, SPECS, TASKS, eval_metrics  # noqa: F401
from visiondist.models.vit import VisionTransformer, init_source

# The detectors' module is imported where a detector is built (noqa: PLC0415): it brings
# torchvision and with it torch._dynamo (0.7-0.85 s of a rank's start), which a ViT never needs.


def _build_vit(cfg: Any) -> nn.Module:
    """Under `torch.device("meta")` the bare meta model (its values come from `init_source`);
    otherwise the model with its initial values: `model.weights`, `model.init_from` or the init
    rules."""
    device = torch.get_default_device()
    with torch.device("meta"):
        model = VisionTransformer(
            img_size=cfg.img_size,
            patch_size=cfg.patch_size,
            num_classes=cfg.num_classes,
            embed_dim=cfg.embed_dim,
            depth=cfg.depth,
            num_heads=cfg.num_heads,
            mlp_ratio=cfg.mlp_ratio,
            qkv_bias=cfg.qkv_bias,
            drop_rate=cfg.drop_rate,
            drop_path_rate=cfg.drop_path_rate,
        )
    return model if device.type == "meta" else materialize(model, device, init_source(cfg, model))


def _build_torchvision(cfg: Any) -> nn.Module:
    from visiondist.models.detection import (  # noqa: PLC0415 (torchvision: see the top)
        build_torchvision_detector,
    )

    return build_torchvision_detector(cfg)


def _build_vitdet(cfg: Any) -> nn.Module:
    from visiondist.models.vitdet import build_vitdet  # noqa: PLC0415 (torchvision: see the top)

    return build_vitdet(cfg)


def _build_detr(cfg: Any) -> nn.Module:
    return build_detr(cfg)


FAMILIES: dict[str, Callable[[Any], nn.Module]] = {
    "vit": _build_vit,
    "torchvision": _build_torchvision,
    "vitdet": _build_vitdet,
    "detr": _build_detr,
}


def build_model(cfg: Any) -> nn.Module:
    """Build the model a `ModelConfig` describes (random init or local weights, nothing
    downloaded).

    Args:
        cfg: the model config (`cfg.model`); its `family` chooses the builder.

    Returns:
        The model: a plain `nn.Module`, on torch's default device.

    Raises:
        ValueError: an unknown family.
    """
    if cfg.family not in FAMILIES:
        raise ValueError(
            f"unknown model.family={cfg.family!r}: known families are {', '.join(FAMILIES)}"
        )
    return FAMILIES[cfg.family](cfg)


# families built on the meta device and initialised per rank after the layout
DEFERRED_INIT = {"vit": init_source}


def build_deferred(cfg: Any, weights: bool = True) -> tuple[nn.Module, Optional[InitSource]]:
    """A ViT: the model on the meta device and the source of its initial values (`weights=False`:
    None, the tensors are left for a checkpoint to fill); `visiondist.models.init.materialize`
    allocates what a rank keeps. Other families: the model built on the CPU and None. Tell the two
    apart with `visiondist.models.init.is_meta`.

    Args:
        cfg: the model config (`cfg.model`).
        weights: read the model's weights files (`model.weights`, `model.init_from`); False: leave
            the tensors for a checkpoint to fill.

    Returns:
        (the model, the source of its initial values or None).
    """
    structure = cfg
    # no weights file is read (a checkpoint fills the tensors); pretrained ones still shape the
    # model
    if not weights:
        # a copy
        cfg = OmegaConf.merge(cfg, {"weights": None, "init_from": None, "backbone_weights": None})
    if cfg.family not in DEFERRED_INIT:
        model = build_model(cfg)
        if not weights and cfg.family == "torchvision":
            from visiondist.models.detection import (  # noqa: PLC0415 (torchvision: see the top)
                pretrained_structure,
            )

            pretrained_structure(model, structure)
        return model, None
    with torch.device("meta"):
        model = build_model(cfg)
    if not weights:
        return model, None
    if not isinstance(model, VisionTransformer):  # what the families of DEFERRED_INIT build
        raise TypeError(f"model.family={cfg.family} built a {type(model).__name__}, not a ViT")
    return model, DEFERRED_INIT[cfg.family](cfg, model)
