"""Model registry: `build_model(cfg.model)` turns a model config into a plain `nn.Module`.

Models here hold no distributed code; `visiondist.parallel` transforms a finished model.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from visiondist.models.vit import VisionTransformer, from_timm_state_dict, select_attention
from visiondist.models.weights import init_from, load_local_weights


def _build_vit(cfg: Any) -> nn.Module:
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
    if cfg.weights:
        load_local_weights(model, cfg.weights, convert=_from_timm_if_fused)
    elif cfg.get("init_from"):
        init_from(model, cfg.init_from, convert=_from_timm_if_fused)
    return model


def _from_timm_if_fused(state: dict) -> dict:
    """timm checkpoints fuse q/k/v into `attn.qkv`; ours keep them apart."""
    return from_timm_state_dict(state) if any(".attn.qkv." in key for key in state) else state


def _build_torchvision(cfg: Any) -> nn.Module:
    from visiondist.models.detection import build_torchvision_detector

    return build_torchvision_detector(cfg)


def _build_vitdet(cfg: Any) -> nn.Module:
    from visiondist.models.detection import build_vitdet

    return build_vitdet(cfg)


FAMILIES: dict[str, Callable[[Any], nn.Module]] = {"vit": _build_vit, "torchvision": _build_torchvision,
                                                    "vitdet": _build_vitdet}
TASKS = {"vit": "classification", "torchvision": "detection", "vitdet": "detection"}  # what each family is trained for


def build_model(cfg: Any) -> nn.Module:
    """Build the model a `ModelConfig` describes (random init, nothing downloaded)."""
    if cfg.family not in FAMILIES:
        raise ValueError(f"unknown model.family={cfg.family!r}: known families are {', '.join(FAMILIES)}")
    return FAMILIES[cfg.family](cfg)
