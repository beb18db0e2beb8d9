"""DETR-class detectors (RT-DETRv2, D-FINE, RF-DETR) from Hugging Face transformers, behind
torchvision's detector contract.

The models, image processors and post-processing are transformers' (`visiondist[detr]`), the loss is
ours (`detr_criterion.py`); nothing is downloaded: a model is built from its configuration (`ARCHS`:
the published variants' architecture values) with random weights, or reads `model.weights` (a local
state dict of this wrapper's keys, a directory in the library's `from_pretrained` layout, or a
Hugging Face repo name from the local cache). `DetrDetector` makes one behave as the torchvision
detectors the trainer, the evaluator and the exports already drive: `model(images, targets)` in
training returns a dict of losses, `model(images)` in evaluation one dict per image with `boxes`
(x1, y1, x2, y2 in that image's pixels, clipped to it as torchvision's detectors clip theirs),
`scores` and `labels`. `detr_library.py` builds it from a config and reads and writes the library's
own layout.

What the wrapper does: each image (float in [0, 1], any size) is resized to the model's square input
(`model.img_size`; in training with `model.multi_scale`, a size drawn per batch) as the model's
image processor does (bilinear, no aspect kept, antialiased when shrinking except for RF-DETR,
ImageNet mean / std for RF-DETR only); the targets' boxes become (cx, cy, w, h) relative to their
image and the labels 0-based (the data's are 1-based, torchvision's convention with 0 the
background); the predictions go through the library's `post_process_object_detection` (the top
`num_queries` of the sigmoid scores over queries x classes) and back to 1-based labels. The loss is
the original implementations' weighted sum (varifocal or IoU-aware classification, L1 and GIoU
boxes, D-FINE's distribution terms, over the decoder layers, denoising or query groups), normalised
by the boxes of the whole batch over every data-parallel rank, with one host transfer a step
(`detr_criterion.py`). `DetrForExport` is the same evaluation as one traceable function (ONNX).
The published variants and how transformers builds them: `detr_archs.py`.
"""

from __future__ import annotations

import functools
import random
import zlib
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from visiondist.models.detr_archs import ARCHS, Arch, _transformers

if TYPE_CHECKING:  # the optional extra [detr]
    from transformers import PreTrainedModel


class DetrDetector(nn.Module):
    """A transformers DETR-class detector with torchvision's detector interface (see the module
    docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        img_size: int,
        arch: Optional[Arch] = None,
        multi_scale: Optional[list[int]] = None,
    ):
        super().__init__()
        self.model = model
        self.img_size = int(img_size)
        self.arch = arch or next(a for a in ARCHS.values() if a.model == type(model).__name__)
        self.multi_scale = list(multi_scale or [])
        # the library ties modules under two names (the heads: `class_embed` is
        # `model.decoder.class_embed`): the state dict keeps one name per tensor, so safetensors
        # files and checkpoints hold each once, and loading fills the other name from it
        self.aliases = _aliases(self)
        # parameters detection never uses stay out of training (no gradient, so no optimizer state a
        # checkpoint could lack): the masked-image-modelling token of RF-DETR's DINOv2
        for name, param in self.named_parameters():
            if name.endswith("embeddings.mask_token"):
                param.requires_grad_(False)
        self.register_state_dict_post_hook(_drop_aliases)
        # the loss is ours (detr_criterion.py): the matching of every layer batched with one host
        # transfer a step, D-FINE's as its paper defines it; the library's model calls it with its
        # raw outputs. Imported here: its `torch.compiler.disable` imports torch._dynamo (1.4 s),
        # which the processes that only read this module's tables (a ViT's rank) never need
        from visiondist.models.detr_criterion import install  # noqa: PLC0415 (dynamo: 1.4 s)

        self.criterion = install(model)
        self.register_load_state_dict_pre_hook(_fill_aliases)

    def compile_region(self) -> nn.Module:
        """What `trainer.compile=model` compiles: the library's network (backbone, encoder,
        decoder), not the per-image resizes before it nor the loss, whose matching runs on the
        host."""
        return self.model.get_submodule("model")

    def input_size(self, targets: Optional[list[dict]] = None) -> int:
        """The square side the model sees: model.img_size, or in training with model.multi_scale one
        of its sizes, drawn per batch from its images' ids (the same batch gets the same size, so a
        resumed run repeats the uninterrupted one; RT-DETR's collate draws one size per batch
        too)."""
        if not (self.training and self.multi_scale and targets):
            return self.img_size
        ids = [int(t["image_id"]) for t in targets if "image_id" in t]
        seed = zlib.crc32(" ".join(map(str, ids)).encode())
        return self.multi_scale[random.Random(seed).randrange(len(self.multi_scale))]

    def pixels(self, images, size: Optional[int] = None) -> torch.Tensor:
        """The batch as the model takes it: `resized`, then normalised where the model is
        (RF-DETR)."""
        return self.normalized(self.resized(images, size))

    def resized(self, images, size: Optional[int] = None) -> torch.Tensor:
        """Each image (float in [0, 1], any size) resized to the square side as the library's image
        processor does (bilinear; antialiased when shrinking where the processor does), stacked."""
        side = size or self.img_size
        out = []
        for im in images:
            im = im[None].float()
            if tuple(im.shape[-2:]) != (side, side):
                im = F.interpolate(
                    im,
                    size=(side, side),
                    mode="bilinear",
                    align_corners=False,
                    antialias=self.arch.antialias,
                )
            out.append(im)
        return torch.cat(out)

    def normalized(self, pixels: torch.Tensor) -> torch.Tensor:
        """The resized batch in the model's input units: ImageNet mean / std for RF-DETR, as it is
        for the others."""
        if not self.arch.normalize:
            return pixels
        mean, std = self.arch.mean_std()
        return (pixels - pixels.new_tensor(mean).view(1, 3, 1, 1)) / pixels.new_tensor(std).view(
            1, 3, 1, 1
        )

    def forward(self, images, targets: Optional[list[dict]] = None):
        sizes = [(int(im.shape[-2]), int(im.shape[-1])) for im in images]
        if self.training:
            if targets is None:
                raise ValueError(
                    "a DETR-class detector in training mode takes targets (boxes, labels)"
                )
            labels = [library_target(t, h, w) for t, (h, w) in zip(targets, sizes)]
            out = self.model(
                pixel_values=self.pixels(images, self.input_size(targets)), labels=labels
            )
            return {"loss": out.loss}
        out = self.model(pixel_values=self.pixels(images))
        return _detections(out, sizes, self.arch.processor)


def _aliases(module: nn.Module) -> dict[str, str]:
    """Second name -> first name of each parameter or buffer registered under two names."""
    first: dict[int, str] = {}
    aliases = {}
    tensors = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, tensor in tensors:
        key = id(tensor)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def _drop_aliases(module: DetrDetector, state: dict, prefix: str, _metadata) -> None:
    for alias in module.aliases:
        state.pop(prefix + alias, None)


def _fill_aliases(module: DetrDetector, state: dict, prefix: str, *_args) -> None:
    for alias, name in module.aliases.items():
        if prefix + alias not in state and prefix + name in state:
            state[prefix + alias] = state[prefix + name]


def library_target(target: dict, height: int, width: int) -> dict:
    """torchvision's target (absolute x1, y1, x2, y2; 1-based labels) as the library's (relative cx,
    cy, w, h; 0-based class labels)."""
    boxes = target["boxes"].float()
    scale = boxes.new_tensor([width, height, width, height])
    x1, y1, x2, y2 = (boxes / scale).unbind(-1)
    relative = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], dim=-1)
    return {"class_labels": target["labels"].long() - 1, "boxes": relative}


@functools.cache
def _processor(name: str):
    return getattr(_transformers(), name)()


def _detections(out, sizes: list[tuple[int, int]], processor: str) -> list[dict]:
    """The library's post-processing (the top `num_queries` of the sigmoid scores over queries x
    classes, boxes in each image's pixels), labels 1-based."""
    processed = _processor(processor).post_process_object_detection(
        out, threshold=0.0, target_sizes=sizes
    )
    return [
        {"boxes": clip_boxes(p["boxes"], h, w), "scores": p["scores"], "labels": p["labels"] + 1}
        for p, (h, w) in zip(processed, sizes)
    ]


def clip_boxes(boxes: torch.Tensor, height, width) -> torch.Tensor:
    """Boxes (x1, y1, x2, y2) clipped to the image, as torchvision's detectors clip theirs (a DETR's
    box may reach past the border); `height` / `width` may be tensors (symbolic under export)."""
    x = boxes[..., 0::2].clamp(min=0)
    y = boxes[..., 1::2].clamp(min=0)
    x = torch.minimum(x, torch.as_tensor(width, dtype=boxes.dtype, device=boxes.device))
    y = torch.minimum(y, torch.as_tensor(height, dtype=boxes.dtype, device=boxes.device))
    return torch.stack([x[..., 0], y[..., 0], x[..., 1], y[..., 1]], dim=-1)


class DetrForExport(nn.Module):
    """The eval-mode detector as one traceable function for ONNX, batched as the DETR-class papers'
    deploy code takes it: `images` (N, 3, S, S), float in [0, 1], each resized to the model's side
    S as `DetrDetector.pixels` resizes it (`resized`), and `sizes` (N, 2), each original's (height,
    width) -> boxes (N, K, 4: x1, y1, x2, y2 in the original's pixels, clipped to it), labels (N, K,
    1-based), scores (N, K) and detections (N: K each), K = the model's queries: what
    `DetrDetector` returns for the originals (the library's post-processing, written with tensor
    ops only)."""

    def __init__(self, detector: DetrDetector):
        super().__init__()
        self.detector = detector

    def forward(self, images: torch.Tensor, sizes: torch.Tensor):
        detector = self.detector
        out = detector.model(pixel_values=detector.normalized(images.float()))
        logits, centres = out.logits, out.pred_boxes
        queries, classes = logits.shape[1], logits.shape[2]
        scores, index = logits.sigmoid().flatten(1).topk(queries, dim=1)
        cx, cy, w, h = centres.unbind(-1)
        corners = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=-1)
        picked = corners.gather(1, (index // classes)[..., None].expand(-1, -1, 4))
        height, width = sizes.to(corners.dtype).unbind(-1)
        scale = torch.stack([width, height, width, height], dim=-1)[:, None]
        boxes = picked * scale
        # inside the image, as `clip_boxes`
        x = torch.minimum(boxes[..., 0::2].clamp(min=0), width[:, None, None])
        y = torch.minimum(boxes[..., 1::2].clamp(min=0), height[:, None, None])
        boxes = torch.stack([x[..., 0], y[..., 0], x[..., 1], y[..., 1]], dim=-1)
        count = torch.ones_like(scores, dtype=torch.int64).sum(dim=1)
        return boxes, index % classes + 1, scores, count

    def resized(self, image: torch.Tensor) -> torch.Tensor:
        """One image (3, H, W), float in [0, 1] -> (3, S, S) as the graph takes it."""
        return self.detector.resized([image])[0]
