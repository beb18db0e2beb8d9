"""The data settings fine-tuning weights bring: a timm name's pretrained config, or what lies
beside a local file (tools/export.py's sidecar, a `config.json` holding timm's `pretrained_cfg`),
applied as the data config's defaults (`apply_data_defaults`), the command line's values winning.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from visiondist.utils.pretrained import (
    is_enum_name,
    is_hf_repo,
    is_timm_name,
    timm_pretrained_cfg,
)


def pretrained_data_defaults(spec: str) -> dict[str, Any]:
    """What timm's pretrained config says the weights expect: data.img_size, mean, std, crop_pct,
    interpolation."""
    return _data_settings(timm_pretrained_cfg(spec).to_dict())


def _data_settings(recorded: dict[str, Any]) -> dict[str, Any]:
    """The data settings in a timm pretrained config or an export's sidecar (input_size, mean,
    std, crop_pct, interpolation) as `data` keys; {} without mean and std."""
    if not isinstance(recorded.get("mean"), (list, tuple)) or not isinstance(
        recorded.get("std"), (list, tuple)
    ):
        return {}
    size = recorded.get("input_size")
    out: dict[str, Any] = {}
    if isinstance(size, (int, list, tuple)) and size:
        out["img_size"] = int(size if isinstance(size, int) else size[-1])
    out["mean"] = [float(v) for v in recorded["mean"]]
    out["std"] = [float(v) for v in recorded["std"]]
    if isinstance(recorded.get("crop_pct"), (int, float)):
        out["crop_pct"] = float(recorded["crop_pct"])
    if recorded.get("interpolation") in ("bilinear", "bicubic"):
        out["interpolation"] = recorded["interpolation"]
    return out


def local_data_defaults(path: Path) -> tuple[dict[str, Any], str]:
    """What a local weights file's neighbours record of its preprocessing, as `data` keys, and
    which file said it: tools/export.py's sidecar `<name>.json`, else a `config.json` beside it
    holding timm's `pretrained_cfg` (a Hugging Face snapshot, `hf download ... --local-dir`).
    ({}, "") where neither does."""
    import json  # noqa: PLC0415 (a local file's)

    sidecar, hub = path.with_suffix(".json"), path.with_name("config.json")
    for file, key in ((sidecar, None), (hub, "pretrained_cfg")):
        if file == path or not file.is_file():
            continue
        try:
            recorded = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        recorded = recorded.get(key) if key and isinstance(recorded, dict) else recorded
        found = _data_settings(recorded) if isinstance(recorded, dict) else {}
        if found:
            return found, file.name
    return {}, ""


def _unrecorded(cfg, path: str, given: set[str]) -> Optional[str]:
    """The line for a local file that records no preprocessing (None where the command line sets
    the normalisation): what the run uses, and what timm's ViT weights mostly expect."""
    if {"data.mean", "data.std"} & given:
        return None
    shown = lambda key: str(OmegaConf.to_container(cfg.data[key])).replace(" ", "")  # noqa: E731
    return (
        f"model.init_from={path}: the file records no preprocessing (no {Path(path).stem}.json "
        f"or config.json beside it): training with data.mean={shown('mean')} "
        f"data.std={shown('std')} data.interpolation={cfg.data.interpolation}; timm's ViT "
        "weights mostly expect data.mean=[0.5,0.5,0.5] data.std=[0.5,0.5,0.5] "
        "data.interpolation=bicubic (their pretrained_cfg): set them on the command line where "
        "yours do"
    )


def apply_data_defaults(cfg, overrides: list[str]) -> Optional[str]:
    """`model.init_from=timm/...`: the weights' pretrained config (input size, mean, std, crop_pct,
    interpolation) replaces the data config's values, except those set on the command line; a local
    file's, as its sidecar or a config.json beside it records them (`local_data_defaults`). Returns
    the line that says so, or for a local file that records nothing, the line saying what the run
    uses."""
    spec = cfg.model.get("init_from")
    if cfg.model.family != "vit" or not spec or is_enum_name(spec) or is_hf_repo(spec):
        return None
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    if is_timm_name(spec):
        wanted, source = pretrained_data_defaults(spec), "its pretrained config"
    else:
        wanted, where = local_data_defaults(Path(spec).expanduser())
        if not wanted:
            return _unrecorded(cfg, spec, given)
        source = f"its {where}"
    changed = []
    for key, value in wanted.items():
        if key not in cfg.data or f"data.{key}" in given:
            continue
        if key == "img_size" and "model.img_size" in given:
            continue
        current = (
            OmegaConf.to_container(cfg.data[key])
            if OmegaConf.is_list(cfg.data[key])
            else cfg.data[key]
        )
        if current != value:
            cfg.data[key] = value
            changed.append(f"data.{key}={value}".replace(" ", ""))
        if key == "img_size":
            patch = int(cfg.model.patch_size)
            cfg.model.img_size = max(1, value // patch) * patch
    if not changed:
        return None
    return (
        f"model.init_from={spec}: {source} sets {' '.join(changed)} (set any on the "
        "command line to keep another)"
    )
