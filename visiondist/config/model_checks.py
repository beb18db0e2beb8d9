"""The model group's checks: sizes, attention kernels, the detectors' settings, and the weights it
names (a timm or torchvision name, a Hugging Face repo or a file) against the model's shape."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from visiondist.config.rules import one_of, positive
from visiondist.config.schema import ConfigError
from visiondist.utils import pretrained as named


def check_model(m: DictConfig) -> None:
    one_of("model.sdpa", m.sdpa, ("auto", "flash", "efficient", "cudnn", "math"))
    for key in ("num_classes", "img_size", "patch_size", "embed_dim", "depth", "num_heads"):
        positive(f"model.{key}", m[key])
    positive("model.mlp_ratio", m.mlp_ratio)
    positive("model.anchor_scale", m.anchor_scale)
    if m.roi_sampling_ratio is not None:
        positive("model.roi_sampling_ratio", m.roi_sampling_ratio)
    # DETR-class: its own rules (registry)
    if m.family in ("vit", "vitdet") and m.img_size % m.patch_size:
        raise ConfigError(
            f"model.img_size={m.img_size} is not a multiple of model.patch_size={m.patch_size} "
            f"({m.name}): use e.g. "
            f"model.img_size={max(1, round(m.img_size / m.patch_size)) * m.patch_size}"
        )
    if m.embed_dim % m.num_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} does not divide model.embed_dim={m.embed_dim}"
        )
    for key in ("drop_rate", "drop_path_rate"):
        if not 0 <= m[key] < 1:
            raise ConfigError(f"model.{key}={m[key]} must be in [0, 1)")
    if m.init_from is not None and m.weights is not None:
        raise ConfigError(
            "set model.weights (exact weights) or model.init_from (fine-tuning start), not both"
        )
    _check_named(m)
    if (
        m.init_from is not None
        and not named.is_named(m.init_from)
        and not Path(m.init_from).expanduser().is_file()
    ):
        raise ConfigError(
            f"model.init_from={m.init_from}: no such file (or a timm name: "
            "timm/<architecture>.<tag>)"
        )
    if m.backbone_weights is not None:
        if (
            not named.is_named(m.backbone_weights)
            and not Path(m.backbone_weights).expanduser().is_file()
        ):
            raise ConfigError(
                f"model.backbone_weights={m.backbone_weights}: no such file (or a torchvision "
                "weights name, e.g. ResNet50_Weights.IMAGENET1K_V2)"
            )
        if not 0 <= m.trainable_backbone_layers <= 5:
            raise ConfigError(
                f"model.trainable_backbone_layers={m.trainable_backbone_layers}: choose 0-5 "
                "(stages of the ResNet that train, from the last)"
            )


def _check_named(m: DictConfig) -> None:
    """Weights given by name: a timm name for model.init_from, torchvision weights for the
    detectors' model.weights and model.backbone_weights; each must exist in the installed library
    (whether it is cached is checked with the inputs, where it may be downloaded)."""
    for key in ("init_from", "weights", "backbone_weights"):
        spec = m[key]
        if spec is None or not named.is_named(spec):
            continue
        if named.is_timm_name(spec) and key != "init_from":
            raise ConfigError(
                f"model.{key}={spec}: timm names start a fine-tune: use model.init_from={spec}"
            )
        if named.is_hf_repo(spec):
            if key != "weights" or m.family != "detr":
                raise ConfigError(
                    f"model.{key}={spec}: no such file; a Hugging Face repo name is read only for "
                    "model.weights of a DETR-class detector (model=rtdetr_v2_r18, dfine_s, "
                    "rfdetr_nano, ...); give a local file here"
                )
            continue
        if named.is_enum_name(spec) and key == "init_from":
            raise ConfigError(
                f"model.init_from={spec}: init_from takes timm names (timm/<architecture>.<tag>); "
                "torchvision's weights go in model.weights (whole detector) or "
                "model.backbone_weights"
            )
        try:
            if named.is_timm_name(spec):
                _check_timm_shape(m, spec)
            else:
                _check_torchvision_weights(m, key, named.torchvision_weights(spec, f"model.{key}"))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _check_timm_shape(m: DictConfig, spec: str) -> None:
    """A timm name's architecture has the model's shape (before anything is downloaded)."""
    theirs = named.timm_shape(spec)
    if theirs is None:
        return
    ours = {key: int(m[key]) for key in theirs}
    if theirs == ours:
        return
    arch = named.timm_pretrained_cfg(spec).architecture
    differ = [key for key in theirs if theirs[key] != ours[key]]
    # the model configs shipped beside the code
    configs = Path(__file__).resolve().parents[2] / "configs" / "model"
    same = sorted(f.stem for f in configs.glob("*.yaml") if f"timm_name: {arch}\n" in f.read_text())
    pick = f"model={same[0]}" if same else f"a model config with timm_name: {arch}"
    raise ConfigError(
        f"model.init_from={spec}: {arch} has "
        + ", ".join(f"{k} {theirs[k]}" for k in differ)
        + f"; model={m.name} has "
        + ", ".join(f"{k} {ours[k]}" for k in differ)
        + f": use {pick}, or set "
        + " ".join(f"model.{k}={theirs[k]}" for k in differ)
    )


def _check_torchvision_weights(m: DictConfig, key: str, weights) -> None:
    """torchvision weights by name are those of the detector's own builder (model.weights) or a
    ResNet-50 (model.backbone_weights)."""
    kind = type(weights).__name__
    if key == "backbone_weights":
        if kind != "ResNet50_Weights":
            raise ConfigError(
                f"model.backbone_weights={kind}.{weights.name}: the ResNet-50 FPN detectors take "
                "ResNet50_Weights (e.g. ResNet50_Weights.IMAGENET1K_V2)"
            )
        return
    if m.family != "torchvision":
        raise ConfigError(
            f"model.weights={kind}.{weights.name}: torchvision weight names are for the "
            f"torchvision detectors; {m.name} takes a local weights file (a ViT starts from "
            "timm's with model.init_from=timm/<name>)"
        )
    # torchvision brings torch (3.5 s), which validating a config otherwise never imports
    from torchvision.models import get_model_weights  # noqa: PLC0415 (torchvision: 3.5 s)

    wanted = get_model_weights(m.arch)
    if type(weights) is not wanted:
        raise ConfigError(
            f"model.weights={kind}.{weights.name} are torchvision's weights of another detector "
            f"than model={m.name} ({m.arch}): use {wanted.__name__}.{next(iter(wanted)).name} or "
            "the model config of those weights"
        )
