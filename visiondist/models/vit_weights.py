"""A ViT's shape read off a weights file's tensor names and shapes (ours or timm's, whose fused
`attn.qkv` is seen split), the model config that builds that shape, and the settings that switch to
it: what `visiondist.models.weights_check` says when a ViT file and the model differ."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

import visiondist
from visiondist.config import ConfigError

_BLOCK = re.compile(r"^blocks\.(\d+)\.")
_FUSED = re.compile(r"^(.*\.attn)\.qkv\.(weight|bias)$")


def split_fused(shapes: dict[str, tuple]) -> dict[str, tuple]:
    """timm's layout (a fused `attn.qkv`) seen under the model's keys (`attn.q`, `attn.k`,
    `attn.v`), as the ViT loader reads it."""
    if not any(_FUSED.match(k) for k in shapes):
        return shapes
    out = {}
    for key, shape in shapes.items():
        match = _FUSED.match(key)
        if match is None:
            out[key] = shape
            continue
        for part in ("q", "k", "v"):
            out[f"{match.group(1)}.{part}.{match.group(2)}"] = (shape[0] // 3, *shape[1:])
    return out


def vit_shape(shapes: dict[str, tuple]) -> Optional[dict[str, Any]]:
    """A ViT classifier's shape from its tensors (ours or timm's names), or None when they are not
    one's."""
    embed = shapes.get("patch_embed.proj.weight")
    if embed is None or len(embed) != 4:
        return None
    blocks = [int(m.group(1)) for k in shapes if (m := _BLOCK.match(k))]
    hidden = shapes.get("blocks.0.mlp.fc1.weight", (0,))[0]
    tokens = shapes.get("pos_embed", (1, 1, 0))[1]
    return {
        "width": embed[0],
        "depth": max(blocks) + 1 if blocks else 0,
        "patch": embed[-1],
        "mlp_ratio": hidden / embed[0],
        "qkv_bias": "blocks.0.attn.q.bias" in shapes,
        "classes": shapes.get("head.weight", (0,))[0],
        "grid": round((tokens - 1) ** 0.5),
    }


# a ViT's shape (`vit_shape`) -> the model config key that sets it (and its default where a config
# leaves it out)
_VIT_KEYS = (
    ("width", "embed_dim", None),
    ("patch", "patch_size", None),
    ("depth", "depth", None),
    ("mlp_ratio", "mlp_ratio", None),
    ("qkv_bias", "qkv_bias", True),
)


def named_vit(vit: dict[str, Any]) -> Optional[str]:
    """The ViT model config of this width, patch, MLP and bias (one of this depth first), or
    None."""
    found = [
        name
        for name, cfg in _vit_configs().items()
        if all(
            _value(cfg, key, default) == vit[field]
            for field, key, default in _VIT_KEYS
            if field != "depth"
        )
    ]
    same_depth = [name for name in found if _vit_configs()[name].depth == vit["depth"]]
    return next(iter(same_depth or found), None)


@functools.lru_cache(maxsize=1)
def _vit_configs() -> dict[str, Any]:
    """The ViT model configs (configs/model/*.yaml of family vit; none where the package was
    installed without them)."""
    folder = Path(visiondist.__file__).resolve().parents[1] / "configs" / "model"
    found: dict[str, Any] = {}
    for file in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        cfg = OmegaConf.load(file)
        if isinstance(cfg, DictConfig) and cfg.get("family") == "vit":  # a model config is a map
            found[str(cfg.name)] = cfg
    return found


def _value(cfg, key: str, default: Any) -> Any:
    value = cfg.get(key, default)
    return float(value) if key == "mlp_ratio" else value


def vit_fix(vit: dict[str, Any], model_cfg=None) -> str:
    """The settings that build a ViT of the file's shape: `model=<config>` of that shape and the
    `model.<key>=` it further needs. Given the config in use (`model_cfg`), keys set on the command
    line (those that differ from its model config's file) count as staying: they are named whenever
    they differ from the file."""
    variant = named_vit(vit)
    configs = _vit_configs()
    # the config to switch to: the file's variant where it is not the one in use
    target = (
        configs[variant]
        if variant is not None and (model_cfg is None or variant != model_cfg.name)
        else None
    )
    mine = configs.get(str(model_cfg.name)) if model_cfg is not None else None
    settings = []
    for field, key, default in _VIT_KEYS:
        if model_cfg is None:
            result = _value(configs[variant], key, default) if variant else None
        else:
            current = _value(model_cfg, key, default)
            overridden = mine is None or _value(mine, key, default) != current
            result = (
                _value(target, key, default) if target is not None and not overridden else current
            )
        if result != vit[field]:
            settings.append(
                f"model.{key}={vit[field]:g}"
                if field == "mlp_ratio"
                else f"model.{key}={str(vit[field]).lower()}"
                if field == "qkv_bias"
                else f"model.{key}={vit[field]}"
            )
    if variant is None and any(s.startswith("model.embed_dim=") for s in settings):
        settings.append(f"model.num_heads=<a divisor of {vit['width']}>")
    if variant is None and model_cfg is None:
        return "use a ViT model config (model=vit_*) with " + " ".join(settings)
    return "use " + " ".join(([f"model={variant}"] if target is not None else []) + settings)


def compare_vits(model_cfg, stored: dict, own: dict, key: str = "model.weights") -> None:
    """The file's ViT shape against the model's: what differs, named with the settings that fix it.
    `key`: model.init_from resamples another image size's position embedding, so only the
    architecture must agree."""
    theirs, ours = vit_shape(stored), vit_shape(own)
    if theirs is None or ours is None:
        return
    spec, name = model_cfg.get(key.split(".")[1]), model_cfg.name
    texts = {
        "width": "{} wide",
        "patch": "patch {}",
        "depth": "{} blocks deep",
        "mlp_ratio": "MLP ratio {:g}",
        "qkv_bias": "qkv bias {}",
    }
    differ = [
        texts[field].format(ours[field])
        for field, _, _ in _VIT_KEYS
        if theirs[field] != ours[field]
    ]
    if differ:
        raise ConfigError(
            f"{key}={spec} is {vit_text(theirs)} but model={name} is {', '.join(differ)}: "
            f"{vit_fix(theirs, model_cfg)}"
        )
    if key == "model.init_from":
        return
    if theirs["grid"] != ours["grid"]:
        size = theirs["grid"] * theirs["patch"]
        raise ConfigError(
            f"model.weights={spec} is a ViT for {size} px images ({theirs['grid']} x "
            f"{theirs['grid']} patches) but model={name} takes {ours['grid'] * ours['patch']} px "
            f"({ours['grid']} x {ours['grid']}): set data.img_size={size} (or start from it with "
            "model.init_from=, which resamples the position embedding)"
        )


def vit_text(vit: dict[str, Any]) -> str:
    """The file's ViT as a message says it: `a vit_tiny (width 192, depth 12, patch 16, 6 classes)`,
    or `a ViT (...)` for a shape no model config has."""
    variant = named_vit(vit)
    named = variant is not None and _vit_configs()[variant].depth == vit["depth"]
    head = f"{vit['classes']} classes" if vit["classes"] else "no classification head"
    shape = f"width {vit['width']}, depth {vit['depth']}, patch {vit['patch']}, {head}"
    return f"a {variant if named else 'ViT'} ({shape})"
