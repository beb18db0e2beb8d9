"""Image transforms (albumentations + OpenCV: the fastest CPU path we measured) and per-sample
seeding."""

from __future__ import annotations

import math
import random

import albumentations as A
import cv2
import numpy as np
import torch
from PIL import Image

from visiondist.data.augment import AugmentPolicy
from visiondist.data.device_decode import CROP_FIELDS, Encoded, EncodedBatch
from visiondist.models.patches import Patches

# data.interpolation -> OpenCV's flag
INTERPOLATIONS = {"bilinear": cv2.INTER_LINEAR, "bicubic": cv2.INTER_CUBIC}


def interpolation(cfg) -> int:
    """OpenCV's flag for `data.interpolation` (bilinear when the config has no such key)."""
    name = (
        cfg.get("interpolation", "bilinear")
        if hasattr(cfg, "get")
        else getattr(cfg, "interpolation", "bilinear")
    )
    if name not in INTERPOLATIONS:
        raise ValueError(f"data.interpolation={name!r}: use one of {', '.join(INTERPOLATIONS)}")
    return INTERPOLATIONS[name]


class CentreCrop:
    """The eval transform: the short side resized to `resize`, then the centre `size` x `size`,
    with the sizes and offsets torchvision's `Resize(resize)` and `CenterCrop(size)` compute (the
    long side truncated, the offsets rounded half to even), which is timm's eval transform: the
    exported model's `timm.data.create_transform` crops the pixels the run scored, whatever the
    image's shape. (albumentations' SmallestMaxSize rounds the long side and its CenterCrop floors
    the offsets: one pixel apart on 2 of 3 shapes, up to 101 levels on an edge.)"""

    def __init__(self, resize: int, size: int, interpolation: int) -> None:
        self.resize, self.size, self.interpolation = resize, size, interpolation

    def geometry(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, left, resized height, resized width) for a `height` x `width` image."""
        if width <= height:
            h, w = int(self.resize * height / width), self.resize
        else:
            h, w = self.resize, int(self.resize * width / height)
        return int(round((h - self.size) / 2.0)), int(round((w - self.size) / 2.0)), h, w

    def __call__(self, image: np.ndarray) -> np.ndarray:
        top, left, h, w = self.geometry(*image.shape[:2])
        if (h, w) != image.shape[:2]:
            image = cv2.resize(image, (w, h), interpolation=self.interpolation)
        return image[top : top + self.size, left : left + self.size]


def classification_transforms(cfg, train: bool, size: int) -> A.Compose | CentreCrop:
    """Train: albumentations' random-resized crop + flip; eval: resize the short side to
    size / crop_pct, centre crop (`CentreCrop`). Both resize with `data.interpolation`. `size` is
    the model's input resolution. Normalisation happens on the device (`Normalize`)."""
    flag = interpolation(cfg)
    if not train:
        # timm's eval size, floor(size / crop_pct) (224 / 0.9 -> 248), so that its transform sees
        # what we score
        return CentreCrop(math.floor(size / cfg.crop_pct), size, flag)
    steps = [
        A.RandomResizedCrop(
            size=(size, size), scale=tuple(cfg.train_crop_scale), interpolation=flag
        )
    ]
    if cfg.hflip > 0:
        steps.append(A.HorizontalFlip(p=cfg.hflip))
    return A.Compose(steps)


class SampleRandom:
    """The random stream of one sample: a numpy generator and a Python one, both set from (seed,
    epoch, index), that every random choice for the sample draws from in turn (albumentations' crop,
    then its flip, then the auto-augment and erasing parameters). One stream, not a seed per
    transform: transforms seeded alike draw alike (a flip would follow the crop's area). Re-set for
    each sample in ~10 us (the generators are reused, not rebuilt)."""

    def __init__(self):
        self.numpy = np.random.Generator(np.random.PCG64(0))
        self.python = random.Random(0)

    def reset(self, seed: int, epoch: int, index: int) -> None:
        words = [
            int(w)
            for w in np.random.SeedSequence([seed, epoch, index]).generate_state(4, np.uint64)
        ]
        self.numpy.bit_generator.state = {
            "bit_generator": "PCG64",
            "has_uint32": 0,
            "uinteger": 0,
            "state": {"state": words[0] << 64 | words[1], "inc": words[2] << 64 | 1},
        }
        self.python.seed(words[3])


class ClassificationTransform:
    """uint8 HxWx3 RGB -> uint8 HxWx3 tensor (`Normalize` makes it CHW on the device): the crop /
    flip (albumentations). In training with `data.auto_augment` or `data.random_erasing`, also the
    sample's augmentation parameters (`visiondist.data.augment`): the worker returns `(image, row)`,
    and applies the auto-augment operations itself only under `data.augment_on=loader`.
    Normalisation happens on the device (`Normalize`): uint8 batches move a quarter of float32's
    bytes through the workers' shared memory, pinning and the copy to the device.

    Every random choice is drawn from the sample's own stream (`SampleRandom`, set from (seed,
    epoch, index)): the augmentation a sample gets does not depend on the rank, the worker or the
    order in which samples are loaded. Runs with different layouts see identical pixels.
    """

    def __init__(self, cfg, train: bool, size: int, seed: int):
        get = (
            cfg.get if hasattr(cfg, "get") else lambda key, default=None: getattr(cfg, key, default)
        )
        self.policy = AugmentPolicy.from_config(cfg, size) if train else None
        self.on_loader = get("augment_on", "device") == "loader"
        # train and eval: one decoder per run
        self.decode_on_device = get("decode_on", "loader") == "device"
        self.train, self.size = train, size
        self.seed = seed
        self.random = SampleRandom()
        self.transform = classification_transforms(cfg, train, size)
        if isinstance(self.transform, A.Compose):
            self.transform.set_random_state(self.random.numpy, self.random.python)

    def __call__(self, image, index: int, epoch: int):
        self.random.reset(self.seed, epoch, index)
        if self.decode_on_device:
            return self._for_device(image)
        image = self._crop(image)
        if self.policy is None or not self.policy.active:
            return image
        row = self.policy.draw(self.random.python)
        if self.on_loader:  # torchvision's ops take C, H, W; handed over as H, W, C again
            image = (
                self.policy.apply_loader(image.permute(2, 0, 1), row).permute(1, 2, 0).contiguous()
            )
        return image, torch.from_numpy(row)

    def _crop(self, image: np.ndarray) -> torch.Tensor:
        """The albumentations crop / flip (train) or resize / centre crop (eval): uint8 H, W, C."""
        if isinstance(self.transform, CentreCrop):
            return torch.from_numpy(np.ascontiguousarray(self.transform(image)))
        return torch.from_numpy(np.ascontiguousarray(self.transform(image=image)["image"]))

    def _for_device(self, image) -> tuple[torch.Tensor, torch.Tensor]:
        """`data.decode_on=device`: a JPEG's bytes with its crop row (train: drawn from the sample's
        stream as the loader path's albumentations crop and flip draw them; eval: the resize and
        centre crop), or a file the device cannot decode cropped here, with an empty crop row; then
        the augmentation row (`visiondist.data.device_decode`)."""
        row = np.zeros(CROP_FIELDS)
        # eval: resize the short side, then the centre crop
        if isinstance(image, Encoded) and isinstance(self.transform, CentreCrop):
            row[:] = (2, *self.transform.geometry(image.height, image.width), 0)
            payload = torch.frombuffer(bytearray(image.data), dtype=torch.uint8)
        # the Compose's draws in its order: whether it runs (p=1), crop, flip
        elif isinstance(image, Encoded):
            assert isinstance(self.transform, A.Compose)  # training's
            self.random.python.random()
            crop, *rest = self.transform.transforms
            x0, y0, x1, y1 = crop.get_params_dependent_on_data(
                {"shape": (image.height, image.width)}, {}
            )["crop_coords"]
            flip = any(isinstance(t, A.HorizontalFlip) and t.should_apply() for t in rest)
            row[:] = (1, y0, x0, y1 - y0, x1 - x0, flip)
            payload = torch.frombuffer(bytearray(image.data), dtype=torch.uint8)
        else:
            payload = self._crop(image)
        if self.policy is not None and self.policy.active:
            row = np.concatenate([row, self.policy.draw(self.random.python)])
        return payload, torch.from_numpy(row)


class Normalize:
    """Loader images -> the model's input on `device`. A classification loader hands over uint8
    batches laid out N, H, W, C (each worker's images stack with a plain memory copy; a CHW view of
    an HWC crop would be transposed in the worker, 10x slower): they are copied without blocking,
    turned to N, C, H, W on the device (`to_device`), and normalised there in float32, (x - 255
    mean) / (255 std) per channel (`normalize`). Float input is taken as the model's input already
    (N, C, H, W, normalised)."""

    def __init__(self, mean, std) -> None:
        self.mean = torch.tensor(list(mean), dtype=torch.float32).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(list(std), dtype=torch.float32).view(1, 3, 1, 1) * 255
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(
        self, images: torch.Tensor | Patches, device: torch.device
    ) -> torch.Tensor | Patches:
        # data.resolution=native: uint8 patches, each pixel's channels together
        if isinstance(images, Patches):
            images = images.to(device, non_blocking=True)
            pixels = images.patches
            if pixels.dtype != torch.uint8:
                return images
            mean, std = (t.to(device).view(-1) for t in (self.mean, self.std))
            shape = pixels.shape
            return images._replace(
                patches=pixels.view(*shape[:-1], -1, 3).float().sub_(mean).div_(std).view(shape)
            )
        return self.normalize(to_device(images, device))

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 N, C, H, W on its device -> normalised float32 (float input passes as it is)."""
        if images.dtype != torch.uint8:
            return images
        if images.device not in self._on:
            self._on[images.device] = (self.mean.to(images.device), self.std.to(images.device))
        mean, std = self._on[images.device]
        return images.float().sub_(mean).div_(std)


def to_device(images, device: torch.device) -> torch.Tensor:
    """A classification loader batch on `device`: uint8 N, H, W, C -> uint8 N, C, H, W (contiguous),
    after a non-blocking copy; a batch of encoded JPEGs (`data.decode_on=device`) is decoded,
    cropped and flipped there; float batches (already the model's input) are only copied."""
    if isinstance(images, EncodedBatch):
        return images.images(device)
    images = images.to(device, non_blocking=True)
    return images.permute(0, 3, 1, 2).contiguous() if images.dtype == torch.uint8 else images


def unit_float(images: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Detection images (uint8 CHW, sizes differ) -> float in [0, 1] on `device`, what torchvision's
    detectors take (they normalise inside); converted after a non-blocking copy of the uint8
    bytes."""
    out = []
    for image in images:
        image = image.to(device, non_blocking=True)
        out.append(image.float().div_(255) if image.dtype == torch.uint8 else image)
    return out


def resize_keep_aspect(
    image: np.ndarray, boxes: np.ndarray, min_size: int, max_size: int, masks=None
):
    """torchvision's detection resize: scale the short side to `min_size` unless the long side would
    pass `max_size`; boxes scaled with it, and (n, H, W) `masks` (nearest neighbour, as torchvision
    resizes them) when given, then returned fourth."""
    h, w = image.shape[:2]
    scale = min(min_size / min(h, w), max_size / max(h, w))
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    image = cv2.resize(image, size, interpolation=cv2.INTER_LINEAR if scale > 1 else cv2.INTER_AREA)
    if masks is None:
        return image, boxes * np.float32(scale)
    resized = [cv2.resize(m, size, interpolation=cv2.INTER_NEAREST) for m in masks]
    masks = np.stack(resized) if resized else np.zeros((0, size[1], size[0]), dtype=np.uint8)
    return image, boxes * np.float32(scale), masks


def resize_square(image: np.ndarray, boxes: np.ndarray, side: int, antialias: bool = True):
    """The image resized to side x side, aspect not kept (a DETR-class detector's input), boxes
    scaled with it: as the model's image processor resizes, to rounding (bilinear; antialiased when
    it shrinks, through PIL, where the processor antialiases, which RF-DETR's does not)."""
    h, w = image.shape[:2]
    if antialias and side < max(h, w):
        image = np.array(Image.fromarray(image).resize((side, side), Image.Resampling.BILINEAR))
    else:
        image = cv2.resize(image, (side, side), interpolation=cv2.INTER_LINEAR)
    return image, boxes * np.array([side / w, side / h, side / w, side / h], dtype=np.float32)


class DetectionTransform:
    """Training augmentation for detection, with boxes: resize keeping the aspect ratio (min_size /
    max_size; with `square`, to that square instead: a DETR-class detector's input), optional
    large-scale jitter (random rescale, then pad / crop to a min_size square), horizontal flip and
    colour jitter. Drawn from the sample's stream (`SampleRandom`) like `ClassificationTransform`.
    Boxes a crop removes (or leaves < 1 px) go, with their labels and masks; masks follow every
    geometric step exactly as the boxes do."""

    def __init__(self, cfg, seed: int, square: int | None = None, antialias: bool = True):
        self.min_size, self.max_size, self.seed, self.square = (
            cfg.min_size,
            cfg.max_size,
            seed,
            square,
        )
        self.antialias = antialias
        steps: list = []
        if cfg.large_scale_jitter:
            lo, hi = cfg.lsj_scale
            side = cfg.min_size
            steps += [
                A.RandomScale(scale_limit=(lo - 1, hi - 1), p=1.0),
                A.PadIfNeeded(
                    min_height=side, min_width=side, position="top_left", border_mode=0, fill=0
                ),
                A.RandomCrop(height=side, width=side),
            ]
        if cfg.hflip > 0:
            steps.append(A.HorizontalFlip(p=cfg.hflip))
        if cfg.color_jitter > 0:
            j = cfg.color_jitter
            steps.append(
                A.ColorJitter(brightness=j, contrast=j, saturation=j, hue=min(0.5, j / 4), p=0.8)
            )
        bbox = A.BboxParams(
            format="pascal_voc",
            label_fields=["labels", "ids"],
            min_width=1,
            min_height=1,
            clip=True,
        )
        self.augment = A.Compose(steps, bbox_params=bbox)
        self.random = SampleRandom()
        self.augment.set_random_state(self.random.numpy, self.random.python)

    def __call__(
        self,
        image: np.ndarray,
        boxes: np.ndarray,
        labels: np.ndarray,
        index: int,
        epoch: int,
        masks: np.ndarray | None = None,
    ):
        """(image, boxes, labels), augmented; with (n, H, W) `masks`, (image, boxes, labels,
        masks)."""
        if self.square and masks is None:
            image, boxes = resize_square(image, boxes, self.square, self.antialias)
        elif masks is None:
            image, boxes = resize_keep_aspect(image, boxes, self.min_size, self.max_size)
        else:
            image, boxes, masks = resize_keep_aspect(
                image, boxes, self.min_size, self.max_size, masks
            )
        self.random.reset(self.seed, epoch, index)
        extra = {"masks": masks} if masks is not None and len(masks) else {}
        out = self.augment(
            image=image, bboxes=boxes, labels=labels, ids=np.arange(len(labels)), **extra
        )
        boxes = np.asarray(out["bboxes"], dtype=np.float32).reshape(-1, 4)
        labels = np.asarray(out["labels"], dtype=np.int64)
        if masks is None:
            return out["image"], boxes, labels
        kept = np.asarray(out["ids"], dtype=np.int64)
        h, w = out["image"].shape[:2]
        masks = np.asarray(out["masks"])[kept] if extra else np.zeros((0, h, w), dtype=np.uint8)
        return out["image"], boxes, labels, masks.reshape(-1, h, w)
