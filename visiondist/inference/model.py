"""The model a prediction runs: built and loaded as `tools/eval.py` loads it (a run's
model.safetensors or a checkpoint of any layout, a weights file in this project's, timm's or
torchvision's keys, a from_pretrained directory), whole on one device in eval mode, with the names
of what it predicts (`visiondist.inference.names`); and one batch turned into per-image results.

Each image is prepared as the run's evaluation prepares it (`visiondist.data`): decoded by the one
reader (EXIF orientation, grey / CMYK / 16-bit / alpha), then a classifier's resize and centre crop
(`ClassificationTransform`, train=False) and normalisation on the device, or a detector's image
whole (the model resizes it, and gives its boxes in the pixels of the image it was given)."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from visiondist.config.resolution import native_settings, reading
from visiondist.data.masks import encode
from visiondist.data.sampler import grouped, padded_shapes
from visiondist.engine.precision import autocast_for
from visiondist.inference.names import Names, kept_labels
from visiondist.models import TASKS, padded_batches
from visiondist.models.exported import runtime_of
from visiondist.models.init import is_meta, materialize
from visiondist.utils.dcp import is_complete

if TYPE_CHECKING:  # rank-side (below)
    from visiondist.data.native import NativeTransform
    from visiondist.data.transforms import ClassificationTransform

log = logging.getLogger(__name__)

# What only the ranks use is imported where it is used ("rank-side" below): tools/predict.py's
# launching process imports this module (through `visiondist.inference.run`) before its ranks
# start, without the loaders' transforms (albumentations: 0.5 s), evaluation (torchvision: 1.8 s),
# DCP (0.8 s) and the model builders (DTensor: 1.3 s).


class Predictor:
    """A loaded model with its preprocessing and names; `prepare` runs in the loader workers,
    `__call__` on the device.

    Args:
        cfg: the prediction's config (its model, data, predict and trainer groups).
        model: the loaded model (`load_model`), in eval mode.
        device: where the model runs.
        names: what its outputs are called (`read_names`).
    """

    def __init__(self, cfg: DictConfig, model: nn.Module, device: torch.device, names: Names):
        self.cfg, self.model, self.device, self.names = cfg, model, device, names
        self.task = TASKS[cfg.model.family]
        self.autocast = autocast_for(cfg.trainer.precision, device) or nullcontext()
        p = cfg.predict
        self.topk = max(1, min(int(p.topk), len(names.classes)))
        self.score_thresh, self.max_det = float(p.score_thresh), int(p.max_det)
        self.keep = None if not p.classes else kept_labels(list(p.classes), names)
        # a torchvision R-CNN or ViTDet pads a forward's images to its largest: one forward for
        # each padded shape in a batch gives each image what it gets alone, as the evaluation does
        self.padded_by = padded_batches(cfg.model) if self.task == "detection" else None
        self.transform: Optional[ClassificationTransform | NativeTransform] = None
        self.reads = None  # how a classifier reads an image (predict.json, the log)
        if self.task == "classification":
            from visiondist.data.transforms import (  # noqa: PLC0415 (rank-side)
                ClassificationTransform,
                Normalize,
            )

            # (data.root: not read)
            data = cast(
                dict[str, Any],
                OmegaConf.to_container(cfg.data, resolve=True, throw_on_missing=False),
            )
            # decoded by the one reader in the workers, as a CPU evaluation decodes
            data["decode_on"] = "loader"
            self.transform = ClassificationTransform(
                _Fields(data), train=False, size=int(cfg.model.img_size), seed=int(cfg.trainer.seed)
            )
            self.normalize = Normalize(cfg.data.mean, cfg.data.std)
            self.collate = None
            self.reads = reading(
                data, int(cfg.model.img_size), int(cfg.model.get("patch_size", 16))
            )
            # as the run evaluated: each image at its own shape
            if data.get("resolution", "square") == "native":
                from visiondist.data.native import (  # noqa: PLC0415 (rank-side)
                    NativeCollate,
                    NativeTransform,
                )

                size, patch = int(cfg.model.img_size), int(cfg.model.patch_size)
                _, eval_len = native_settings(data, size, patch)
                self.transform = NativeTransform(
                    _Fields(data), False, patch, int(cfg.trainer.seed), eval_len, size
                )
                self.collate = NativeCollate(patch, [eval_len])

    def prepare(self, image: np.ndarray, index: int) -> torch.Tensor:
        """An upright HxWx3 uint8 RGB image -> the loader's tensor: a classifier's crop (uint8 H, W,
        C), a detector's whole image (uint8 C, H, W)."""
        if self.transform is not None:
            return self.transform(image, index, 0)
        return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).contiguous()

    @torch.no_grad()
    def __call__(self, images: list[torch.Tensor]) -> list[dict[str, Any]]:
        """One batch of prepared images -> a result per image (`results`' fields without the item's
        own)."""
        if self.task == "classification":
            # data.resolution=native: patch sequences, in the images' order
            if self.collate is not None:
                batch = self.normalize(
                    self.collate([(image, 0) for image in images])[0], self.device
                )
            else:
                batch = self.normalize(torch.stack(images), self.device)
            with self.autocast:
                logits = self.model(batch)
            probs = logits.float().softmax(dim=1)
            top = probs.topk(self.topk, dim=1)
            values, labels = top.values.cpu().tolist(), top.indices.cpu().tolist()
            return [
                {
                    "top": [
                        {"label": k, "name": self.names.classes[k], "prob": p}
                        for k, p in zip(ks, ps)
                    ]
                }
                for ks, ps in zip(labels, values)
            ]
        from visiondist.data.transforms import unit_float  # noqa: PLC0415 (rank-side)

        outputs: list[Any] = [None] * len(images)
        for group in self._shape_groups(images):
            with self.autocast:
                found = self.model(unit_float([images[i] for i in group], self.device))
            for i, output in zip(group, found):
                outputs[i] = output
        return [{"detections": self._detections(output)} for output in outputs]

    def _shape_groups(self, images: list[torch.Tensor]) -> list[list[int]]:
        """The batch's positions, one list for each padded shape (in the order of its first
        image); the whole batch where the model does not pad (a DETR-class model)."""
        if self.padded_by is None or len(images) < 2:
            return [list(range(len(images)))]
        sizes = np.array([[image.shape[-1], image.shape[-2]] for image in images])
        # the evaluation's grouping, in batches as large as this one
        return grouped(range(len(images)), len(images), padded_shapes(sizes, *self.padded_by))

    def _detections(self, output: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        scores = output["scores"].float()
        keep = scores >= self.score_thresh
        if self.keep is not None:
            keep &= torch.isin(output["labels"], torch.tensor(self.keep, device=scores.device))
        index = torch.nonzero(keep).flatten()
        index = index[scores[index].argsort(descending=True, stable=True)][: self.max_det]
        boxes = output["boxes"].float()[index].cpu().tolist()
        labels = output["labels"][index].cpu().tolist()
        kept = scores[index].cpu().tolist()
        rles = None
        if "masks" in output:
            from visiondist.evaluation.detection import MASK_THRESHOLD  # noqa: PLC0415 (rank-side)

            rles = encode((output["masks"][index, 0] > MASK_THRESHOLD).cpu().numpy())
        cats, classes = self.names.categories, self.names.classes
        found = []
        for j, (box, label, score) in enumerate(zip(boxes, labels, kept)):
            item = {
                "box": box,
                "score": score,
                "label": int(label),
                "name": classes[label - 1] if 0 < label <= len(classes) else f"label {label}",
                "category_id": cats[label - 1] if cats and 0 < label <= len(cats) else int(label),
            }
            if rles is not None:
                item["mask"] = rles[j]
            found.append(item)
        return found


class _Fields(dict):
    """A data config as a dict that also reads by attribute (what the transforms take)."""

    __getattr__ = dict.__getitem__


def load_model(cfg: DictConfig, device: torch.device) -> nn.Module:
    """The model of `cfg.model` with the weights of `cfg.model.weights` (a checkpoint directory of
    any layout, or what training's model.weights takes), whole, on `device`, in eval mode.

    Args:
        cfg: the prediction's config (`model`, with the weights to load).
        device: where the model goes.

    Returns:
        The model.
    """
    from visiondist.checkpoint.dcp import (  # noqa: PLC0415 (rank-side)
        freeze_as_saved,
        load_model_state,
    )
    from visiondist.models import build_deferred, select_attention  # noqa: PLC0415 (rank-side)

    weights = Path(cfg.model.weights) if cfg.model.weights else None
    if weights is not None and runtime_of(weights):  # an exported file, run by its runtime
        from visiondist.checkpoint.export.runtimes import load_runtime  # noqa: PLC0415

        return load_runtime(cfg.model, weights, device)
    checkpoint = weights if weights is not None and is_complete(weights) else None
    select_attention(cfg.model.sdpa)
    torch.manual_seed(int(cfg.trainer.seed))
    model, source = build_deferred(cfg.model, weights=checkpoint is None)
    if checkpoint is not None and not is_meta(model):
        freeze_as_saved(checkpoint, model)
    if is_meta(model):
        materialize(model, device, source)
    if checkpoint is not None:
        ema = bool(cfg.model.get("weights_ema", False))
        load_model_state(checkpoint, model, no_dist=True, ema=ema)
    model = model.to(device).eval()
    if cfg.model.get("channels_last"):
        model = model.to(memory_format=torch.channels_last)
    # a ViT's fixed shapes: one graph (and one more for a last, smaller batch)
    if compiles(cfg, device):
        model = torch.compile(model)
    return model


def compiles(cfg: DictConfig, device: torch.device) -> bool:
    """Whether a prediction compiles its model: a ViT on a GPU unless trainer.compile=false (a
    detector's input sizes change from image to image: eager)."""
    return (
        device.type == "cuda"
        and cfg.model.family == "vit"
        and str(cfg.trainer.compile).lower()
        not in (
            # native: shapes change
            "false",
            "0",
            "none",
        )
        and cfg.data.get("resolution", "square") != "native"
    )
