"""What each model family is and supports: one `ModelSpec` per family (what it is trained for, the
data it reads, and which layouts and switches it supports, sequence parallelism coming with tensor
parallelism; the shape the memory planner counts). `check_support` turns a config that asks a family
for something it does not support into one `ConfigError` naming the fix (`visiondist.plan.check`,
which the CLI and the layout resolver call, runs it after the per-group validation)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from omegaconf import DictConfig

from visiondist.config import ConfigError
from visiondist.config.layout import check_pipeline, divisors
from visiondist.config.schema import DETECTION_FORMATS
from visiondist.models.shape import ViTShape

# switches a family may support: what each is, for the refusal message
TP, PP, FSDP, AC, COMPILE, CLASSIFICATION_AUG, INIT_FROM, BACKBONE_WEIGHTS, FP8 = (
    "tp",
    "pp",
    "fsdp",
    "ac",
    "compile",
    "classification_aug",
    "init_from",
    "backbone_weights",
    "fp8",
)


@dataclass(frozen=True)
class ModelSpec:
    family: str
    task: str  # "classification" | "detection"
    data_format: str  # "imagefolder" | "coco"
    supports: frozenset[str]
    # transformer blocks (the unit of FSDP, activation checkpointing, compile, pipeline stages)
    has_blocks: bool
    rules: Callable[[DictConfig], None] = lambda cfg: None  # the family's own shape rules
    # model config -> the memory model's shape; None: parallel=auto runs the family DDP
    planner_shape: Optional[Callable[[DictConfig], Any]] = None

    def check(self, cfg: DictConfig) -> None:
        """Refuse what this family does not support, with today's wording; then its own shape
        rules."""
        for feature, asked in _requested(cfg).items():
            if asked and feature not in self.supports:
                raise ConfigError(_REFUSALS[feature](cfg))
        self.rules(cfg)


def _requested(cfg: DictConfig) -> dict[str, bool]:
    m, d, p, t = cfg.model, cfg.data, cfg.parallel, cfg.trainer
    return {
        TP: p.tp > 1,
        PP: p.pp > 1,
        FSDP: bool(p.fsdp),
        AC: bool(p.activation_checkpointing),
        # auto compiles only what has blocks
        COMPILE: t.compile in (True, "model", "blocks"),
        INIT_FROM: m.init_from is not None,
        CLASSIFICATION_AUG: d.mixup > 0
        or d.cutmix > 0
        or t.label_smoothing > 0
        or d.auto_augment != "none",
        BACKBONE_WEIGHTS: m.backbone_weights is not None,
        FP8: str(t.get("fp8", "off")) != "off",
    }


_REFUSALS: dict[str, Callable[[DictConfig], str]] = {
    TP: lambda c: (
        f"parallel.tp={c.parallel.tp}: tensor parallelism shards ViT blocks; {c.model.name} has "
        "none: use parallel.tp=1 (parallel=ddp)"
    ),
    FP8: lambda c: (
        f"trainer.fp8={c.trainer.fp8} runs transformer blocks' linear layers in float8; "
        f"{c.model.name} has none: drop it"
    ),
    COMPILE: lambda c: (
        f"trainer.compile={str(c.trainer.compile).lower()} compiles transformer blocks; "
        f"{c.model.name} has none: drop it"
    ),
    CLASSIFICATION_AUG: lambda c: (
        "data.mixup / data.cutmix / data.auto_augment / trainer.label_smoothing are for "
        f"classification; {c.model.name} is a detector: drop them"
    ),
    INIT_FROM: lambda c: (
        f"model.init_from is for ViT classifiers; for {c.model.name} use model.weights"
    ),
    BACKBONE_WEIGHTS: lambda c: (
        f"model.backbone_weights is for the ResNet-50 FPN detectors; {c.model.name} has no "
        "ResNet-50 backbone (use model.weights for a whole model)"
    ),
    FSDP: lambda c: (
        f"parallel.fsdp=true shards ViT classifiers; {c.model.name} is a detector: use DDP "
        "(parallel=ddp, or drop parallel.fsdp)"
    ),
    AC: lambda c: (
        f"parallel.activation_checkpointing recomputes transformer blocks; {c.model.name} has none"
    ),
    PP: lambda c: (
        f"parallel.pp={c.parallel.pp}: pipeline parallelism cuts ViT classifiers into stages of "
        f"blocks; {c.model.name} is a detector: use parallel.pp=1"
    ),
}


# configs/model's timm ViTs by size, with their heads: the next one a tensor-parallel degree divides
_VIT_HEADS = (("vit_tiny", 3), ("vit_small", 6), ("vit_base", 12), ("vit_large", 16))


def _check_blocks(cfg: DictConfig) -> None:
    """Tensor parallelism shards attention by whole heads and the MLP by rows; pipelines need a
    block per stage."""
    m, p = cfg.model, cfg.parallel
    if m.num_heads % p.tp:
        devices = cfg.trainer.get("devices")
        per_node = devices if isinstance(devices, int) and devices > 0 else None
        # a tensor-parallel group sits inside a node: degrees the node's ranks hold
        good = ", ".join(
            str(x) for x in divisors(m.num_heads) if per_node is None or per_node % x == 0
        )
        heads = [h for h in range(p.tp, m.embed_dim + 1, p.tp) if m.embed_dim % h == 0]
        other = min(heads, key=lambda h: (abs(h - m.num_heads), -h)) if heads else None
        more = (
            f", or model.num_heads={other} (a multiple of {p.tp} that divides "
            f"model.embed_dim={m.embed_dim}"
            + (f": no longer timm's {m.name})" if m.name in dict(_VIT_HEADS) else ")")
            if other is not None
            else ""
        )
        bigger = next(
            (name for name, heads in _VIT_HEADS if heads > m.num_heads and heads % p.tp == 0), None
        )
        if bigger is not None:
            more += f", or model={bigger}, timm's next ViT that parallel.tp={p.tp} divides"
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide model.num_heads={m.num_heads} ({m.name}): tensor "
            f"parallelism shards attention by whole heads; use parallel.tp in {{{good}}}{more}"
        )
    hidden = int(m.embed_dim * m.mlp_ratio)
    if hidden % p.tp:
        good = ", ".join(str(x) for x in divisors(math.gcd(hidden, m.num_heads)))
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide the MLP hidden size {hidden} of {m.name} "
            f"(embed_dim x mlp_ratio): use parallel.tp in {{{good}}}"
        )
    try:
        check_pipeline(p.pp, p.schedule, p.stages_per_rank, p.microbatches, m.depth)
    except ValueError as exc:
        raise ConfigError(f"{exc} ({m.name})") from None


def _check_vitdet(cfg: DictConfig) -> None:
    if 32 % cfg.model.patch_size:
        raise ConfigError(
            f"model.patch_size={cfg.model.patch_size} must divide 32 (detection batches are "
            "padded to 32)"
        )
    _check_blocks(cfg)


def _check_detr(cfg: DictConfig) -> None:
    from visiondist.models.detr_archs import ARCHS  # noqa: PLC0415 (the DETR variants alone)

    m = cfg.model
    if m.arch not in ARCHS:
        raise ConfigError(
            f"model.arch={m.arch!r} is not a DETR-class detector here: use one of "
            f"{', '.join(ARCHS)}"
        )
    arch = ARCHS[m.arch]
    scales = [int(s) for s in m.get("multi_scale") or []]
    if m.get("num_queries") is not None and int(m.num_queries) < 1:
        raise ConfigError(
            f"model.num_queries={m.num_queries}: give at least 1 (null: the published 300)"
        )
    queries = int(m.num_queries or 300)
    if scales and int(m.img_size) not in scales:
        raise ConfigError(
            f"model.multi_scale={scales} does not hold model.img_size={m.img_size}: the schedule "
            "draws training sizes around the evaluation size; set model.multi_scale=null, or a "
            f"list around {m.img_size}"
        )
    for size, key in [
        (int(m.img_size), "model.img_size"),
        *((s, "model.multi_scale") for s in scales),
    ]:
        if size % arch.multiple:
            raise ConfigError(
                f"{key}: {size} is not a multiple of {arch.multiple} ({arch.multiple_why} for "
                f"{m.name}): use {size // arch.multiple * arch.multiple or arch.multiple}"
            )
        # the encoder's candidate positions
        positions = sum((size // stride) ** 2 for stride in arch.strides)
        if positions < queries:
            need = next(
                s
                for s in range(32, 100000, 32)
                if sum((s // t) ** 2 for t in arch.strides) >= queries
            )
            raise ConfigError(
                f"{key}: {size} px gives {m.name} {positions} candidate positions (strides "
                f"{', '.join(map(str, arch.strides))}), fewer than its {queries} queries: use >= "
                f"{need} px or set model.num_queries={positions}"
            )
    if m.get("masks"):
        raise ConfigError(
            f"model.masks=true: {m.name} predicts boxes only; for masks use "
            "model=maskrcnn_mobilenet_v3 (or maskrcnn_r50)"
        )
    if cfg.data.get("large_scale_jitter"):
        raise ConfigError(
            "data.large_scale_jitter=true crops torchvision-style squares of data.min_size; "
            f"{m.name} takes its own square input (model.img_size) and scales "
            "(model.multi_scale): set data.large_scale_jitter=false"
        )
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            f"{m.name} is a transformers model, and transformers is not installed: "
            "pip install -e '.[detr]'"
        )


def _check_torchvision(cfg: DictConfig) -> None:
    if cfg.model.backbone_weights is not None and "resnet50" not in str(cfg.model.arch):
        raise ConfigError(_REFUSALS[BACKBONE_WEIGHTS](cfg))
    masks, mask_arch = cfg.model.get("masks"), str(cfg.model.arch).startswith("maskrcnn")
    if masks and not mask_arch:
        raise ConfigError(
            f"model.masks=true adds a mask head to ViTDet; {cfg.model.name} is torchvision's "
            f"{cfg.model.arch}: use model=maskrcnn_r50, maskrcnn_r50_v2 or maskrcnn_mobilenet_v3"
        )
    if masks is False and mask_arch:
        box_model = str(cfg.model.name).replace("maskrcnn", "fasterrcnn")
        raise ConfigError(
            f"model.masks=false: {cfg.model.name} is torchvision's Mask R-CNN, which always "
            f"predicts masks; for boxes only use model={box_model}"
        )


def _check_classifier(cfg: DictConfig) -> None:
    if cfg.model.get("masks"):
        raise ConfigError(
            f"model.masks=true adds a mask head to a detector; {cfg.model.name} is a classifier: "
            "use model=maskrcnn_mobilenet_v3 (or a vitdet_* model with model.masks=true) and "
            "data=shapes_coco or coco"
        )
    _check_blocks(cfg)


_VIT = frozenset({TP, PP, FSDP, AC, COMPILE, CLASSIFICATION_AUG, INIT_FROM, FP8})
SPECS: dict[str, ModelSpec] = {  # how each family is built: visiondist.models.FAMILIES
    "vit": ModelSpec(
        "vit", "classification", "imagefolder", _VIT, True, _check_classifier, ViTShape.from_config
    ),
    "vitdet": ModelSpec(
        "vitdet", "detection", "coco", frozenset({TP, AC, COMPILE, FP8}), True, _check_vitdet
    ),
    "torchvision": ModelSpec(
        "torchvision", "detection", "coco", frozenset({BACKBONE_WEIGHTS}), False, _check_torchvision
    ),
    "detr": ModelSpec("detr", "detection", "coco", frozenset({COMPILE}), False, _check_detr),
}

TASKS = {family: spec.task for family, spec in SPECS.items()}  # what each family is trained for
# each task's evaluation metrics, as metrics.csv names them (trainer.best_metric picks one)
EVAL_METRICS = {
    "classification": (
        "val_loss",
        "val_top1",
        "val_top5",
        "val_ema_loss",
        "val_ema_top1",
        "val_ema_top5",
    ),
    "detection": (
        "val_mAP",
        "val_AP50",
        "val_AP75",
        "val_APs",
        "val_APm",
        "val_APl",
        "val_AR1",
        "val_AR10",
        "val_AR100",
        "val_ARs",
        "val_ARm",
        "val_ARl",
        "val_detections",
        "val_ema_mAP",
    ),
    # a detector with a mask head reports these beside the box stats (`detection.has_masks`)
    "segmentation": (
        "val_segm_mAP",
        "val_segm_AP50",
        "val_segm_AP75",
        "val_segm_APs",
        "val_segm_APm",
        "val_segm_APl",
        "val_segm_AR1",
        "val_segm_AR10",
        "val_segm_AR100",
        "val_segm_ARs",
        "val_segm_ARm",
        "val_segm_ARl",
        "val_ema_segm_mAP",
    ),
}


def padded_batches(model_cfg) -> Optional[tuple[int, int]]:
    """A torchvision R-CNN's or ViTDet's (min_size, max_size): it resizes each image by them and
    pads a batch to its largest (by 32), which changes what the convolutions see at the padded
    edges (ViTDet's attention attends to the padding too): the evaluation's batches and each
    prediction forward hold images of one padded shape. None for a DETR-class model, which sees
    every image at its square."""
    if model_cfg.family not in ("torchvision", "vitdet"):
        return None
    return int(model_cfg.min_size), int(model_cfg.max_size)


def eval_metrics(cfg: Any) -> tuple[str, ...]:
    """The evaluation metrics a model (its `ModelConfig`) reports: its task's, and the mask stats of
    a mask model.

    Args:
        cfg: the model config (`cfg.model`).

    Returns:
        The metric names, as metrics.csv's columns (`EVAL_METRICS`).
    """
    names = EVAL_METRICS[TASKS[cfg.family]]
    if TASKS[cfg.family] != "detection":
        return names
    from visiondist.models.detection import (  # noqa: PLC0415 (torchvision: see _check_detr)
        has_masks,  # torchvision: only where a detector is asked about
    )

    return (*names, *EVAL_METRICS["segmentation"]) if has_masks(cfg) else names


def spec_of(model_cfg: Any) -> ModelSpec:
    if model_cfg.family not in SPECS:
        raise ConfigError(
            f"model.family={model_cfg.family!r} is not supported: use one of {', '.join(SPECS)}"
        )
    return SPECS[model_cfg.family]


def check_support(cfg: DictConfig) -> None:
    """The model family against the rest of the config: the data it reads, the layout and switches
    it supports, its shape rules. One `ConfigError` naming the fix."""
    spec = spec_of(cfg.model)
    # shards hold either: the preflight checks their kind; every detection format is read as COCO
    readable = DETECTION_FORMATS if spec.data_format == "coco" else (spec.data_format,)
    if cfg.data.format not in ("shards", *readable):
        kind = "a detector" if spec.task == "detection" else "a classifier"
        raise ConfigError(
            f"model={cfg.model.name} is {kind} but data={cfg.data.name} is {cfg.data.format} "
            "data: use "
            + (
                "data=shapes_coco, data=coco or data=detection (YOLO, VOC, COCO exports)"
                if kind == "a detector"
                else "data=shapes or data=imagenet"
            )
        )
    d = cfg.data
    # aspect groups draw from the whole epoch
    streams_apply = spec.task != "detection" or not d.aspect_grouping
    if d.format == "shards" and streams_apply and d.streams > 0 and d.batch_size % d.streams:
        raise ConfigError(
            f"data.batch_size={d.batch_size} is not divisible by data.streams={d.streams}: set "
            "data.streams to a divisor of the batch (and a multiple of the number of nodes)"
        )
    spec.check(cfg)
