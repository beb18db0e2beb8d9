"""Detectors: torchvision's, built with random weights (never downloaded), and what every
torchvision-style detector here shares (the heads' class count, local pretrained weights, frozen
stages, fp32 boxes); the ViT-backbone Faster R-CNN is `vitdet.py`.

Every detector is a torchvision detection model: `model(images, targets)` returns a dict of losses
in training and `model(images)` a list of {boxes, labels, scores} in eval, boxes in the input
images' pixel coordinates. A model with a mask head (torchvision's Mask R-CNN,
`maskrcnn_mobilenet_v3_large_fpn`, ViTDet with `model.masks=true`: `has_masks`) also takes each
target's "masks" and returns each image's "masks" (n, 1, H, W), probabilities at the input's size.
It resizes (`min_size` / `max_size`) and normalises internally. Labels are 1..num_classes; 0 is the
background.

Under bf16 autocast the boxes stay fp32 (`keep_boxes_fp32`): bf16 holds 8 significant bits, so an
anchor or box corner near 1000 px is off by up to 4 px and one past 1024 by up to 8; the backbone
and heads still run in bf16.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torchvision.models.detection as tvd
from torch import nn
from torchvision.models import mobilenet_v3_large
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.backbone_utils import _mobilenet_extractor

from visiondist.models.weights import freeze_batchnorms, load_local_weights, read_state
from visiondist.utils.pretrained import is_enum_name, local_file

log = logging.getLogger(__name__)

TORCHVISION_DETECTORS = {
    name: getattr(tvd, name)
    for name in (
        "fasterrcnn_resnet50_fpn",
        "fasterrcnn_resnet50_fpn_v2",
        "fasterrcnn_mobilenet_v3_large_fpn",
        "fasterrcnn_mobilenet_v3_large_320_fpn",
        "retinanet_resnet50_fpn",
        "retinanet_resnet50_fpn_v2",
        "fcos_resnet50_fpn",
        "maskrcnn_resnet50_fpn",
        "maskrcnn_resnet50_fpn_v2",
    )
}


def has_masks(cfg: Any) -> bool:
    """Whether the model predicts instance masks: torchvision's `maskrcnn_*` architectures, or
    ViTDet with `model.masks=true`."""
    return bool(cfg.get("masks")) or str(cfg.get("arch") or "").startswith("maskrcnn")


def has_mask_head(model: nn.Module) -> bool:
    """A built detector predicts masks: a torchvision R-CNN (ViTDet included) whose RoI heads have a
    mask head."""
    heads = getattr(model, "roi_heads", None)
    return heads is not None and heads.has_mask()


def maskrcnn_mobilenet_v3_large_fpn(
    *, weights=None, weights_backbone=None, num_classes: int = 91, **kwargs
) -> nn.Module:
    """Mask R-CNN (torchvision's `MaskRCNN`) on the MobileNetV3-Large FPN backbone, anchors and RPN
    threshold that `fasterrcnn_mobilenet_v3_large_fpn` builds; torchvision has no builder of this
    name. Random weights only."""
    if weights is not None or weights_backbone is not None:
        raise ValueError(
            "maskrcnn_mobilenet_v3_large_fpn has no pretrained weights: start from "
            "model.weights=<local state dict of this model>"
        )
    # plain BatchNorm2d (not MobileNetV3's eps 1e-3 / momentum 0.01), every stage training: as
    # torchvision builds the backbone of its detectors from random weights
    backbone = _mobilenet_extractor(
        mobilenet_v3_large(weights=None, norm_layer=nn.BatchNorm2d), True, 6
    )
    anchor_sizes = ((32, 64, 128, 256, 512),) * 3
    anchors = AnchorGenerator(anchor_sizes, ((0.5, 1.0, 2.0),) * len(anchor_sizes))
    return tvd.MaskRCNN(
        backbone, num_classes, rpn_anchor_generator=anchors, **{"rpn_score_thresh": 0.05, **kwargs}
    )


BUILDERS = {
    **TORCHVISION_DETECTORS,
    "maskrcnn_mobilenet_v3_large_fpn": maskrcnn_mobilenet_v3_large_fpn,
}


def build_torchvision_detector(cfg: Any) -> nn.Module:
    if cfg.arch not in BUILDERS:
        raise ValueError(
            f"model.arch={cfg.arch!r} is not a known torchvision detector: {', '.join(BUILDERS)}"
        )
    kwargs = dict(cfg.kwargs or {})
    model = BUILDERS[cfg.arch](
        weights=None,
        weights_backbone=None,
        num_classes=cfg.num_classes + 1,
        min_size=cfg.min_size,
        max_size=cfg.max_size,
        **kwargs,
    )
    adapt_detector(model, cfg)
    keep_boxes_fp32(model)
    if getattr(cfg, "backbone_weights", None):
        # a torchvision name: torch hub's cache
        path = str(local_file(cfg.backbone_weights, "model.backbone_weights"))
        load_backbone(model, path, cfg.trainable_backbone_layers, frozen_bn=_frozen_bn(cfg))
    if cfg.weights and is_enum_name(cfg.weights):
        load_pretrained_detector(model, cfg)
    elif cfg.weights:
        load_local_weights(model, cfg.weights)
    return model


# the class-dependent tensors of torchvision's detectors: a start from weights of another class
# count (COCO's 91) leaves them at their initialisation
_CLASS_HEADS = (
    "roi_heads.box_predictor.cls_score.",
    "roi_heads.box_predictor.bbox_pred.",
    "roi_heads.mask_predictor.mask_fcn_logits.",
    "head.classification_head.cls_logits.",
)


def load_pretrained_detector(model: nn.Module, cfg: Any) -> None:
    """`model.weights=<torchvision weights name>`, e.g. FasterRCNN_ResNet50_FPN_Weights.COCO_V1: the
    whole detector as torchvision builds it with `weights=`: the backbone's BatchNorms frozen
    (FrozenBatchNorm2d; not in the v2 models), all but the last `trainable_backbone_layers` backbone
    stages frozen, and the classifier (and box regressor) of another class count left at their
    initialisation."""
    state = read_state(str(local_file(cfg.weights, "model.weights")), "model.weights")
    body = model.get_submodule("backbone.body")
    if _frozen_bn(cfg):
        freeze_batchnorms(body)
        state = {
            k: v
            for k, v in state.items()
            if not (k.startswith("backbone.body.") and k.endswith("num_batches_tracked"))
        }
    own = model.state_dict()
    fresh = [
        k
        for k in state
        if k in own and state[k].shape != own[k].shape and k.startswith(_CLASS_HEADS)
    ]
    for key in fresh:
        del state[key]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in fresh]
    if missing or unexpected:
        raise ValueError(
            f"model.weights={cfg.weights} does not fit model.arch={cfg.arch}: missing "
            f"{', '.join(missing[:5]) or 'nothing'}; unexpected "
            f"{', '.join(unexpected[:5]) or 'nothing'}"
        )
    freeze_backbone_stages(body, cfg.trainable_backbone_layers)
    if fresh:
        log.info(
            "model.weights=%s: %s re-initialised (the weights have another number of classes)",
            cfg.weights,
            ", ".join(sorted({k.rsplit(".", 1)[0] for k in fresh})),
        )


def _frozen_bn(cfg: Any) -> bool:
    """torchvision builds its pretrained detectors with FrozenBatchNorm2d in the backbone, except
    the v2 models."""
    return not str(cfg.arch).endswith("_v2")


def pretrained_structure(model: nn.Module, cfg: Any) -> None:
    """What starting from pretrained weights (`model.weights` by name, `model.backbone_weights`)
    changes in a detector besides its tensors, applied without reading them (a resumed run, eval,
    export): frozen BatchNorms and frozen early stages."""
    if not (cfg.get("backbone_weights") or is_enum_name(cfg.get("weights"))):
        return
    body = model.get_submodule("backbone.body")
    if _frozen_bn(cfg):
        freeze_batchnorms(body)
    freeze_backbone_stages(body, cfg.trainable_backbone_layers)


def freeze_backbone_stages(body: nn.Module, trainable_layers: int) -> None:
    """As torchvision does for pretrained backbones: only the last `trainable_layers` stages train
    (ResNet: conv1, layer1..layer4, plus bn1 at 5; MobileNetV3: the stages between its strided
    blocks)."""
    if hasattr(body, "layer4"):
        trainable = ["layer4", "layer3", "layer2", "layer1", "conv1"][:trainable_layers]
        if trainable_layers == 5:
            trainable.append("bn1")
        for name, param in body.named_parameters():
            param.requires_grad_(any(name.startswith(layer) for layer in trainable))
        return
    blocks = list(body.children())
    stages = (
        [0] + [i for i, b in enumerate(blocks) if getattr(b, "_is_cn", False)] + [len(blocks) - 1]
    )
    trainable_layers = min(trainable_layers, len(stages))
    freeze_before = len(blocks) if trainable_layers == 0 else stages[len(stages) - trainable_layers]
    for block in blocks[:freeze_before]:
        for param in block.parameters():
            param.requires_grad_(False)


def load_backbone(model: nn.Module, path: str, trainable_layers: int, frozen_bn: bool) -> None:
    """What torchvision's `weights_backbone` does, from a local resnet50 state dict: load it into
    the backbone (its classifier `fc.*` is not part of a detector), turn the BatchNorms into
    FrozenBatchNorm2d (the v1 detectors) and freeze all but the last `trainable_layers` of conv1,
    layer1..layer4."""
    body = model.get_submodule("backbone.body")
    state = {
        k: v
        for k, v in read_state(path, "model.backbone_weights").items()
        if not k.startswith("fc.")
    }
    if frozen_bn:
        freeze_batchnorms(body)
        state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    missing, unexpected = body.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"model.backbone_weights={path} is not a resnet50 state dict: missing "
            f"{', '.join(missing[:5]) or 'nothing'}; unexpected "
            f"{', '.join(unexpected[:5]) or 'nothing'}"
        )
    freeze_backbone_stages(body, trainable_layers)


def adapt_detector(model: nn.Module, cfg: Any) -> None:
    """Settings that change no parameter shape, so weights stay interchangeable with torchvision's
    model: `anchor_scale` multiplies every anchor size (small objects: 0.5 turns 32..512 into
    16..256) and `roi_sampling_ratio` sets RoIAlign's samples per bin side (box and mask
    RoIAlign)."""
    scale = float(getattr(cfg, "anchor_scale", 1.0))  # ranges are checked by config.validate
    owner = model.get_submodule("rpn") if hasattr(model, "rpn") else model
    generator: AnchorGenerator = owner.get_submodule("anchor_generator")
    if scale != 1.0:
        sizes = tuple(tuple(max(1, round(s * scale)) for s in level) for level in generator.sizes)
        owner.anchor_generator = AnchorGenerator(sizes, generator.aspect_ratios)
    ratio = getattr(cfg, "roi_sampling_ratio", None)
    if ratio is not None:
        pool = getattr(getattr(model, "roi_heads", None), "box_roi_pool", None)
        if pool is None:
            raise ValueError(
                f"model.roi_sampling_ratio applies to R-CNN detectors; {type(model).__name__} has "
                "no RoI pooling: leave it unset"
            )
        pool.sampling_ratio = int(ratio)
        # Mask R-CNN: its RoIAlign likewise
        mask_pool = getattr(model.roi_heads, "mask_roi_pool", None)
        if mask_pool is not None:
            mask_pool.sampling_ratio = int(ratio)


def _float(out: Any) -> Any:
    """`out` (a tensor, or lists / tuples / dicts of them) with every floating tensor in fp32."""
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, dict):
        return type(out)((k, _float(v)) for k, v in out.items())
    if isinstance(out, (list, tuple)):
        return type(out)(_float(v) for v in out)
    return out


def _anchors_in_fp32(_generator: nn.Module, args: tuple) -> tuple:
    """AnchorGenerator draws its anchors in the feature maps' dtype and reads nothing else of them
    but their shape and device: hand it fp32 stand-ins of the same shapes (expanded scalars, no
    memory)."""
    image_list, feature_maps = args
    return image_list, [torch.zeros((), device=f.device).expand(f.shape) for f in feature_maps]


def keep_boxes_fp32(model: nn.Module) -> None:
    """Anchors, box regressions and therefore decoded proposals and boxes in fp32 under any
    autocast: a forward pre-hook on the anchor generator, forward hooks casting the box heads'
    outputs (RPN head, RoI box predictor, RetinaNet / FCOS head). Hooks change no parameter name, so
    the weights stay torchvision's."""
    owner = model.get_submodule("rpn") if hasattr(model, "rpn") else model
    handles = [owner.get_submodule("anchor_generator").register_forward_pre_hook(_anchors_in_fp32)]
    heads = [
        getattr(getattr(model, "rpn", None), "head", None),
        getattr(getattr(model, "roi_heads", None), "box_predictor", None),
        # mask logits, pasted in fp32
        getattr(getattr(model, "roi_heads", None), "mask_predictor", None),
        model.get_submodule("head")
        if hasattr(model, "head") and not hasattr(model, "rpn")
        else None,
    ]
    handles += [
        head.register_forward_hook(lambda _module, _inputs, out: _float(out))
        for head in heads
        if head is not None
    ]
    _FP32_HOOKS[model] = handles


_FP32_HOOKS: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()


def drop_fp32_hooks(model: nn.Module) -> nn.Module:
    """Remove `keep_boxes_fp32`'s hooks (they change nothing in fp32): TorchScript cannot script
    Python hooks, and ONNX export traces the model in fp32."""
    for handle in _FP32_HOOKS.pop(model, []):
        handle.remove()
    return model
