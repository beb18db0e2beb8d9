"""The preprocessing record of an export: what the exported file's own metadata names (classes, a
detector's label -> COCO category map) and the sidecar JSON beside it (how to rebuild the model that
loads the weights, its input size, normalisation, crop, interpolation and decoding; timm's
`pretrained_cfg` entries for a ViT)."""

from __future__ import annotations

import json
import logging
from typing import Any, Optional, Sequence, cast

from omegaconf import OmegaConf

from visiondist.checkpoint.export.trained import Trained, input_size
from visiondist.data.decode import POLICY
from visiondist.models import TASKS
from visiondist.models.detection import TORCHVISION_DETECTORS
from visiondist.models.detr_archs import ARCHS

log = logging.getLogger(__name__)


def label_map(trained: Trained) -> Optional[dict[str, dict[str, Any]]]:
    """A detector's labels: {"<k>": {"category_id": the annotation file's category id, "name": its
    name}} for each label k = 1..K the model predicts (0 is the background); the COCO loader numbers
    the annotation file's category ids in increasing order. None for classifiers and for runs whose
    category ids are unknown."""
    if TASKS[trained.cfg.model.family] != "detection" or trained.categories is None:
        return None
    return _labels(trained.classes, trained.categories)


def _labels(classes: Optional[list[str]], categories: list[int]) -> dict[str, dict[str, Any]]:
    names: Sequence[Optional[str]] = classes or [None] * len(categories)
    return {
        str(label): {"category_id": int(cat), "name": name}
        for label, (cat, name) in enumerate(zip(categories, names), start=1)
    }


def outputs_metadata(
    detection: bool, classes: Optional[list[str]], categories: Optional[list[int]]
) -> dict[str, str]:
    """A weights file's metadata naming the model's outputs (JSON text): "classes", a classifier's
    logits in order; "labels", a detector's label map (`label_map`); {} where they are unknown."""
    if detection:
        return {} if categories is None else {"labels": json.dumps(_labels(classes, categories))}
    return {"classes": json.dumps(list(classes))} if classes else {}


def name_metadata(trained: Trained) -> dict[str, str]:
    """What the exported file's own metadata says of the model and its outputs: "model", its config
    name (what tools/eval.py and predict.py take as model= where none is given); (JSON text)
    "source", the weights it holds (`source_record`); "classes", the names of a classifier's
    logits in order; "labels", a detector's `label_map`."""
    detection = TASKS[trained.cfg.model.family] == "detection"
    if not detection and not trained.classes:
        log.warning(
            "the run records no class names (exported from %s): the file's metadata names no "
            "classes",
            trained.source,
        )
    return {
        "model": str(trained.cfg.model.name),
        "source": json.dumps(source_record(trained)),
        **outputs_metadata(detection, trained.classes, trained.categories),
    }


def source_record(trained: Trained) -> dict[str, Any]:
    """The weights an export holds: the checkpoint's (or weights file's) path, its step, and
    whether they are its EMA."""
    return {
        "path": str(trained.source),
        "step": trained.step,
        **({"weights": "the checkpoint's EMA"} if trained.ema else {}),
    }


def preprocessing_metadata(trained: Trained) -> dict[str, str]:
    """A classifier's eval preprocessing in its file's own metadata ("preprocessing": JSON text of
    mean, std, crop_pct, interpolation), for a graph that takes normalised images and has no
    sidecar; {} for a detector, whose graph takes images in [0, 1]."""
    cfg = trained.cfg
    if cfg.model.family != "vit":
        return {}
    return {
        "preprocessing": json.dumps(
            {
                "mean": [float(v) for v in cfg.data.mean],
                "std": [float(v) for v in cfg.data.std],
                "crop_pct": float(cfg.data.crop_pct),
                "interpolation": str(cfg.data.get("interpolation", "bilinear")),
            }
        )
    }


def timm_data_config(trained: Trained) -> dict[str, Any]:
    """The run's eval preprocessing as entries of timm's `pretrained_cfg`
    (`create["pretrained_cfg_overlay"]`): what `timm.data.resolve_model_data_config(model)` reads
    (input size, interpolation, crop, mean / std; the test-time ones equal to them), plus the head's
    size and the class names."""
    cfg, size = trained.cfg, int(trained.cfg.model.img_size)
    crop_pct = float(cfg.data.crop_pct)
    overlay: dict[str, Any] = {
        "input_size": [3, size, size],
        "test_input_size": [3, size, size],
        "fixed_input_size": True,
        "interpolation": str(cfg.data.get("interpolation", "bilinear")),
        "crop_pct": crop_pct,
        "test_crop_pct": crop_pct,
        "crop_mode": "center",
        "mean": [float(v) for v in cfg.data.mean],
        "std": [float(v) for v in cfg.data.std],
        "num_classes": int(cfg.model.num_classes),
    }
    if trained.classes:
        overlay["label_names"] = list(trained.classes)
    return overlay


def sidecar(trained: Trained) -> dict[str, Any]:
    """How to rebuild the model that loads the exported weights, and what its inputs are (how the
    run decoded its images included)."""
    cfg, m = trained.cfg, trained.cfg.model
    info: dict[str, Any] = {
        "model": m.name,
        "task": TASKS[m.family],
        "num_classes": int(m.num_classes),
        "classes": trained.classes,
        "input_size": input_size(cfg),
        "mean": list(cfg.data.mean),
        "std": list(cfg.data.std),
        "decode": dict(POLICY),
        "source": source_record(trained),
    }
    labels = label_map(trained)
    if labels is not None:  # detectors: label k -> the annotation file's category id and name
        info["labels"] = labels
    if m.family == "vit":
        info.update(
            interpolation=str(cfg.data.get("interpolation", "bilinear")),
            crop_pct=float(cfg.data.crop_pct),
        )
        create = {
            "model_name": m.timm_name or "vit_base_patch16_224",
            "num_classes": int(m.num_classes),
            "img_size": int(m.img_size),
            "patch_size": int(m.patch_size),
            "embed_dim": int(m.embed_dim),
            "depth": int(m.depth),
            "num_heads": int(m.num_heads),
            "mlp_ratio": float(m.mlp_ratio),
            "qkv_bias": bool(m.qkv_bias),
            # timm.data.resolve_model_data_config(model) then gives the run's preprocessing,
            # not timm's defaults for model_name (224 px, its mean / std and crop)
            "pretrained_cfg_overlay": timm_data_config(trained),
        }
        info.update(
            library="timm",
            create=create,
            usage="model = timm.create_model(**create, pretrained=False); model.load_state_dict("
            "safetensors.torch.load_file(path), strict=True); the run's eval preprocessing: "
            "timm.data.create_transform(**timm.data.resolve_model_data_config(model))",
        )
    elif m.family == "torchvision":
        info.update(_torchvision_info(m))
    elif m.family == "detr":
        # the square resize and the normalisation happen inside the model (DetrDetector)
        arch = ARCHS[m.arch]
        mean, std = arch.mean_std()
        info.update(
            mean=list(mean),
            std=list(std),
            library="visiondist",
            usage="visiondist.models.build_model(config.model), then load_state_dict (images in "
            "[0, 1] of any size: the model resizes and normalises); tools/export.py "
            f"format=hf writes the directory transformers' {arch.model}.from_pretrained "
            "reads; format=onnx runs in ONNX Runtime",
        )
    else:
        info.update(
            library="visiondist",
            usage="visiondist.models.build_model(config.model), then load_state_dict; "
            "no other library has this architecture (format=onnx runs without "
            "visiondist, in ONNX Runtime)",
        )
    return info


def _torchvision_info(m) -> dict[str, Any]:
    """A torchvision detector's sidecar entries: the builder (or, where torchvision has none, its
    classes assembled by `usage`, Python to run as written), its keyword arguments, and what the
    keyword arguments cannot carry."""
    info: dict[str, Any] = {}
    kwargs = {
        "weights": None,
        "weights_backbone": None,
        "num_classes": int(m.num_classes) + 1,
        "min_size": int(m.min_size),
        "max_size": int(m.max_size),
        **cast(dict[str, Any], OmegaConf.to_container(m.kwargs, resolve=True)),
    }
    sampling = _sampling_statements(m)
    info.update(
        library="torchvision",
        builder=f"torchvision.models.detection.{m.arch}",
        kwargs=kwargs,
        usage=f"model = builder(**kwargs){sampling}; "
        "model.load_state_dict(safetensors.torch.load_file(path), strict=True); labels are "
        "1..num_classes (0 is the background); labels[str(k)] holds label k's COCO "
        "category_id and name",
    )
    # torchvision's classes, assembled as no builder of its does
    if m.arch not in TORCHVISION_DETECTORS:
        info.update(
            builder="torchvision.models.detection.MaskRCNN",
            kwargs=_without_weights(kwargs),
            usage=(
                "import torch, torchvision, safetensors.torch; from torchvision.models.detection "
                "import MaskRCNN; from torchvision.models.detection.anchor_utils import "
                "AnchorGenerator; from torchvision.models.detection.backbone_utils import "
                "_mobilenet_extractor; backbone = "
                "_mobilenet_extractor(torchvision.models.mobilenet_v3_large("
                "norm_layer=torch.nn.BatchNorm2d), True, "
                "6); anchors = AnchorGenerator(((32, 64, 128, 256, 512),) * 3, ((0.5, 1.0, "
                "2.0),) * 3); model = MaskRCNN(backbone, rpn_anchor_generator=anchors, "
                f"rpn_score_thresh=0.05, **kwargs){sampling}; "
                "model.load_state_dict(safetensors.torch.load_file(path), strict=True)  (kwargs: "
                "this file's kwargs; path: the .safetensors file; labels are 1..num_classes, 0 "
                "is the background)"
            ),
        )
    if float(m.anchor_scale) != 1.0 or m.roi_sampling_ratio is not None:
        info["not_in_kwargs"] = {
            "anchor_scale": float(m.anchor_scale),
            "roi_sampling_ratio": m.roi_sampling_ratio,
            "note": "the weights load unchanged; to reproduce the outputs exactly, scale the "
            "builder's anchor sizes (rpn_anchor_generator) by anchor_scale; usage sets "
            "RoIAlign's sampling_ratio",
        }
    return info


def _without_weights(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The builder's keyword arguments that torchvision's model classes take (not a builder's
    `weights`)."""
    return {k: v for k, v in kwargs.items() if k not in ("weights", "weights_backbone")}


def _sampling_statements(m) -> str:
    """`model.roi_sampling_ratio` as the statements that set it on torchvision's model (box and mask
    RoIAlign), so that the usage reproduces the run's outputs exactly; "" when the run used
    torchvision's own."""
    if m.roi_sampling_ratio is None:
        return ""
    pools = ["box_roi_pool", *(["mask_roi_pool"] if str(m.arch).startswith("maskrcnn") else [])]
    return "".join(
        f"; model.roi_heads.{pool}.sampling_ratio = {int(m.roi_sampling_ratio)}" for pool in pools
    )
