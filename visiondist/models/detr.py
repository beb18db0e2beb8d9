"""DETR-class detectors (RT-DETRv2, D-FINE) from Hugging Face transformers, behind torchvision's detector contract.

The models, their Hungarian-matching losses and their post-processing are transformers' (`visiondist[detr]`);
nothing is downloaded: a model is built from its configuration (`ARCHS`: the published variants' architecture
values) with random weights. `DetrDetector` makes one behave as the torchvision detectors the trainer, the evaluator
and the exports already drive: `model(images, targets)` in training returns a dict of losses, `model(images)` in
evaluation one dict per image with `boxes` (x1, y1, x2, y2 in that image's pixels), `scores` and `labels`.

What the wrapper does: each image (float in [0, 1], any size) is resized to the model's square input
(`model.img_size`, 640 for the published models), as the library's image processor does (bilinear, no aspect kept,
no normalisation for RT-DETR and D-FINE); the targets' boxes become (cx, cy, w, h) relative to their image and the
labels 0-based (the data's are 1-based, torchvision's convention with 0 the background); the predictions go through
the library's `post_process_object_detection` (the top `num_queries` of the sigmoid scores over queries x classes)
and back to 1-based labels. The loss is the library's weighted sum (focal / varifocal classification, L1 and GIoU
boxes, and for D-FINE the fine-grained distribution terms, over the decoder layers and denoising groups), normalised
by the boxes of the whole batch over every data-parallel rank as the original implementations do (the library divides
by this rank's boxes; the wrapper rescales).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

# model.arch -> (transformers config class, model class, architecture values of the published variant; a model built
# from them has the published parameter count: RT-DETRv2-S 20.2M, -L 42.9M, D-FINE-S 10.3M at COCO's 80 classes)
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # RT-DETRv2 (lyuwenyu/RT-DETR, Apache-2.0): ResNet-vd backbones, hybrid encoder, deformable decoder
    "rtdetr_v2_r18": ("RTDetrV2Config", "RTDetrV2ForObjectDetection", {
        "backbone_config": {"model_type": "rt_detr_resnet", "hidden_sizes": [64, 128, 256, 512],
                            "depths": [2, 2, 2, 2], "layer_type": "basic", "out_indices": [2, 3, 4]},
        "encoder_in_channels": [128, 256, 512], "hidden_expansion": 0.5, "decoder_layers": 3}),
    "rtdetr_v2_r50": ("RTDetrV2Config", "RTDetrV2ForObjectDetection", {}),
    # D-FINE (Peterande/D-FINE, Apache-2.0): HGNetV2 backbones, fine-grained distribution refinement of the boxes
    "dfine_s": ("DFineConfig", "DFineForObjectDetection", {
        "backbone_config": {"model_type": "hgnet_v2", "stem_channels": [3, 16, 16],
                            "stage_in_channels": [16, 64, 256, 512], "stage_mid_channels": [16, 32, 64, 128],
                            "stage_out_channels": [64, 256, 512, 1024], "stage_num_blocks": [1, 1, 2, 1],
                            "stage_downsample": [False, True, True, True],
                            "stage_light_block": [False, False, True, True], "stage_kernel_size": [3, 3, 5, 5],
                            "stage_numb_of_layers": [3, 3, 3, 3], "use_learnable_affine_block": True,
                            "hidden_sizes": [64, 256, 512, 1024], "out_indices": [2, 3, 4]},
        "encoder_in_channels": [256, 512, 1024], "hidden_expansion": 0.5, "depth_mult": 0.34, "decoder_layers": 3}),
}


def _transformers():
    from visiondist.compat import quiet_pytree

    try:
        quiet_pytree()  # transformers imports torchao where it is installed (here, or when it builds a model)
        import transformers
    except ImportError as e:  # the optional extra
        raise ImportError("DETR-class detectors are transformers' models: pip install -e '.[detr]'") from e
    return transformers


def build_hf_detector(arch: str, num_classes: int, overrides: Optional[dict] = None) -> nn.Module:
    """transformers' model of `arch` for `num_classes` object classes (no background class), random weights."""
    if arch not in ARCHS:
        raise ValueError(f"model.arch={arch!r} is not a DETR-class detector here: use one of {', '.join(ARCHS)}")
    transformers = _transformers()
    config_name, model_name, values = ARCHS[arch]
    values = {**values, **(overrides or {})}
    backbone = values.pop("backbone_config", None)
    config = getattr(transformers, config_name)(num_labels=num_classes, **values)
    if backbone is not None:
        kind = dict(backbone)
        config.backbone_config = transformers.AutoConfig.for_model(kind.pop("model_type"), **kind)
    return getattr(transformers, model_name)(config)


def build_detr(cfg: Any) -> nn.Module:
    """`model.family=detr`: the `DetrDetector` of `model.arch` for `model.num_classes` classes at `model.img_size`,
    random weights or `model.weights` (a local state dict of this wrapper's keys)."""
    model = DetrDetector(build_hf_detector(str(cfg.arch), int(cfg.num_classes), dict(cfg.kwargs or {})),
                         int(cfg.img_size))
    if cfg.weights:
        from visiondist.models.weights import load_local_weights

        load_local_weights(model, str(cfg.weights))
    return model


class DetrDetector(nn.Module):
    """A transformers DETR-class detector with torchvision's detector interface (see the module docstring)."""

    def __init__(self, model: nn.Module, img_size: int):
        super().__init__()
        self.model = model
        self.img_size = int(img_size)
        # the library ties modules under two names (the heads: `class_embed` is `model.decoder.class_embed`): the
        # state dict keeps one name per tensor, so safetensors files and checkpoints hold each once, and loading
        # fills the other name from it
        self.aliases = _aliases(self)
        self.register_state_dict_post_hook(_drop_aliases)
        self.register_load_state_dict_pre_hook(_fill_aliases)

    def _inputs(self, images) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        sizes = [(int(im.shape[-2]), int(im.shape[-1])) for im in images]
        size = (self.img_size, self.img_size)
        pixels = torch.cat([F.interpolate(im[None].float(), size=size, mode="bilinear", align_corners=False)
                            for im in images])
        return pixels, sizes

    def forward(self, images, targets: Optional[list[dict]] = None):
        pixels, sizes = self._inputs(images)
        if self.training:
            if targets is None:
                raise ValueError("a DETR-class detector in training mode takes targets (boxes, labels)")
            labels = [_relative(t, h, w) for t, (h, w) in zip(targets, sizes)]
            out = self.model(pixel_values=pixels, labels=labels)
            return {"loss": out.loss * _global_box_scale(labels, out.loss.device)}
        out = self.model(pixel_values=pixels)
        return _detections(out, sizes)


def _aliases(module: nn.Module) -> dict[str, str]:
    """Second name -> first name of each parameter or buffer registered under two names."""
    first: dict[int, str] = {}
    aliases = {}
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        key = id(tensor)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def _drop_aliases(module: "DetrDetector", state: dict, prefix: str, _metadata) -> None:
    for alias in module.aliases:
        state.pop(prefix + alias, None)


def _fill_aliases(module: "DetrDetector", state: dict, prefix: str, *_args) -> None:
    for alias, name in module.aliases.items():
        if prefix + alias not in state and prefix + name in state:
            state[prefix + alias] = state[prefix + name]


def _relative(target: dict, height: int, width: int) -> dict:
    """torchvision's target (absolute x1, y1, x2, y2; 1-based labels) as the library's (relative cx, cy, w, h;
    0-based class labels)."""
    boxes = target["boxes"].float()
    scale = boxes.new_tensor([width, height, width, height])
    x1, y1, x2, y2 = (boxes / scale).unbind(-1)
    relative = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], dim=-1)
    return {"class_labels": target["labels"].long() - 1, "boxes": relative}


def _global_box_scale(labels: list[dict], device: torch.device) -> torch.Tensor:
    """The library divides its losses by this rank's boxes (at least 1); the original implementations by the mean
    over data-parallel ranks of the whole batch's boxes. The factor turning one into the other (1 on one rank)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return torch.ones((), device=device)
    boxes = sum(len(t["class_labels"]) for t in labels)
    total = torch.tensor(float(boxes), device=device)
    dist.all_reduce(total)  # over every rank: DP ranks hold different images, TP / PP ranks the same (none here)
    mean = torch.clamp(total / dist.get_world_size(), min=1.0)
    return max(boxes, 1) / mean


def _detections(out, sizes: list[tuple[int, int]]) -> list[dict]:
    from transformers import RTDetrImageProcessor

    processed = RTDetrImageProcessor().post_process_object_detection(out, threshold=0.0, target_sizes=sizes)
    return [{"boxes": p["boxes"], "scores": p["scores"], "labels": p["labels"] + 1} for p in processed]
