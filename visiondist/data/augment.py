"""Auto-augmentation (torchvision's RandAugment and TrivialAugmentWide) and random erasing (timm's),
drawn per sample in the loader worker and applied either there or on the device to the whole batch
at once.

A worker draws each sample's parameters from the sample's own random stream
(`visiondist.data.transforms`): the auto-augment operations with their magnitudes and the erasing
box. They travel with the batch as one float64 row per sample (`AugmentParams`), so what a sample
gets depends on (seed, epoch, index) only, never on the rank, the worker or the place it runs: the
device path and the loader path apply the same parameters.

- Loader (`data.augment_on=loader`): torchvision's functional ops on each uint8 image, as
  torchvision's own `RandAugment` / `TrivialAugmentWide` apply them.
- Device (`data.augment_on=device`, the default): the same ops on the uint8 batch after the copy,
  one call per operation for all the samples that drew it, with per-sample magnitudes
  (`visiondist.data.augment_ops`). The workers then only read, decode, crop and flip.

Random erasing always runs on the device, after normalisation (its noise is in normalised units, as
timm's).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

AUTO_AUGMENT = ("none", "rand", "trivial")
AUGMENT_ON = ("device", "loader")
ERASE_MODES = ("pixel", "rand", "const")

# The operations of torchvision's policies, in its order; an operation is stored as its index here.
OPS = (
    "Identity",
    "ShearX",
    "ShearY",
    "TranslateX",
    "TranslateY",
    "Rotate",
    "Brightness",
    "Color",
    "Contrast",
    "Sharpness",
    "Posterize",
    "Solarize",
    "AutoContrast",
    "Equalize",
)
GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
SIGNED = (
    "ShearX",
    "ShearY",
    "TranslateX",
    "TranslateY",
    "Rotate",
    "Brightness",
    "Color",
    "Contrast",
    "Sharpness",
)


def _magnitudes(policy: str, bins: int, height: int, width: int) -> dict[str, list[float] | None]:
    """Each operation's magnitude bins, computed as torchvision computes them (float32 `linspace`),
    so that a bin gives torchvision's value to the last bit."""

    def lin(hi, lo=0.0):
        return [float(v) for v in torch.linspace(lo, hi, bins)]

    def posterize(levels):
        return [float(v) for v in (8 - (torch.arange(bins) / ((bins - 1) / levels))).round().int()]

    if policy == "rand":
        space = dict(
            ShearX=lin(0.3),
            ShearY=lin(0.3),
            TranslateX=lin(150.0 / 331.0 * width),
            TranslateY=lin(150.0 / 331.0 * height),
            Rotate=lin(30.0),
            Posterize=posterize(4),
        )
        space.update({k: lin(0.9) for k in ("Brightness", "Color", "Contrast", "Sharpness")})
    else:  # trivial: TrivialAugmentWide's wide ranges
        space = dict(
            ShearX=lin(0.99),
            ShearY=lin(0.99),
            TranslateX=lin(32.0),
            TranslateY=lin(32.0),
            Rotate=lin(135.0),
            Posterize=posterize(6),
        )
        space.update({k: lin(0.99) for k in ("Brightness", "Color", "Contrast", "Sharpness")})
    space["Solarize"] = lin(0.0, 1.0)
    return {op: space.get(op) for op in OPS}


def op_argument(op: str, magnitude: float) -> float:
    """The argument torchvision's functional op gets for a signed magnitude
    (`_apply_image_or_video_transform`): shear in degrees, whole pixels of translation, degrees of
    rotation, the factor of a colour op, posterize's bits, solarize's threshold on 0..255."""
    if op in ("ShearX", "ShearY"):
        return math.degrees(math.atan(magnitude))
    if op in ("TranslateX", "TranslateY", "Posterize"):
        return float(int(magnitude))
    if op in ("Brightness", "Color", "Contrast", "Sharpness"):
        return 1.0 + magnitude
    if op == "Solarize":
        return 255.0 * magnitude
    return magnitude  # Rotate (degrees); 0 for the ops without one


@dataclass(frozen=True)
class AugmentParams:
    """Where each field sits in a sample's parameter row: `rounds` (operation index, argument)
    pairs, then the erasing box (flag, top, left, height, width) and the noise seed."""

    rounds: int

    @property
    def width(self) -> int:
        return 2 * self.rounds + 6

    def erase_slice(self) -> slice:
        return slice(2 * self.rounds, 2 * self.rounds + 6)


class AugmentPolicy:
    """What `data.auto_augment` / `data.random_erasing` ask of one training crop of `size` x `size`.
    `draw(r)` is a sample's row of parameters from its `random.Random` stream; `apply_loader`
    applies a row's operations to one uint8 CHW image in the worker."""

    def __init__(
        self,
        auto_augment: str = "none",
        size: int = 224,
        random_erasing: float = 0.0,
        erase_mode: str = "pixel",
        magnitude: int = 9,
        bins: int = 31,
        num_ops: int = 2,
    ):
        if auto_augment not in AUTO_AUGMENT:
            raise ValueError(
                f"data.auto_augment={auto_augment!r}: use one of {', '.join(AUTO_AUGMENT)}"
            )
        if erase_mode not in ERASE_MODES:
            raise ValueError(
                f"data.random_erasing_mode={erase_mode!r}: use one of {', '.join(ERASE_MODES)}"
            )
        if not 0.0 <= random_erasing <= 1.0:
            raise ValueError(
                f"data.random_erasing={random_erasing} is a probability: use a value in [0, 1]"
            )
        self.auto, self.size, self.erase_p, self.erase_mode = (
            auto_augment,
            size,
            float(random_erasing),
            erase_mode,
        )
        self.magnitude, self.bins = magnitude, bins
        rounds = {"none": 0, "rand": num_ops, "trivial": 1}[auto_augment]
        self.layout = AugmentParams(rounds)
        self.space = _magnitudes(auto_augment, bins, size, size) if rounds else {}

    @classmethod
    def from_config(cls, d, size: int) -> AugmentPolicy:
        """The policy a data config asks for at crop size `size` (keys it lacks: off)."""
        get = d.get if hasattr(d, "get") else lambda key, default=None: getattr(d, key, default)
        return cls(
            get("auto_augment", "none") or "none",
            size,
            float(get("random_erasing", 0.0) or 0.0),
            get("random_erasing_mode", "pixel") or "pixel",
        )

    @property
    def active(self) -> bool:
        return bool(self.layout.rounds) or self.erase_p > 0

    def draw(self, r: random.Random) -> np.ndarray:
        """One sample's parameters, drawn as torchvision's policies draw (an operation uniformly;
        RandAugment's fixed magnitude bin or TrivialAugment's uniform one; a sign with probability
        1/2) and as timm's `RandomErasing` draws its box (area 2%-33%, log-uniform aspect 0.3-3.3,
        10 attempts)."""
        row = np.zeros(self.layout.width, dtype=np.float64)
        for k in range(self.layout.rounds):
            op = OPS[r.randrange(len(OPS))]
            bins = self.space[op]
            magnitude = 0.0
            if bins is not None:
                magnitude = bins[self.magnitude if self.auto == "rand" else r.randrange(self.bins)]
                if op in SIGNED and r.random() <= 0.5:
                    magnitude = -magnitude
            row[2 * k], row[2 * k + 1] = OPS.index(op), op_argument(op, magnitude)
        if self.erase_p > 0 and r.random() < self.erase_p:
            e = 2 * self.layout.rounds
            box = _erase_box(r, self.size, self.size)
            if box is not None:
                row[e : e + 5] = (1.0, *box)
                row[e + 5] = r.getrandbits(31)
        return row

    def apply_loader(self, image: torch.Tensor, row: np.ndarray) -> torch.Tensor:
        """A row's auto-augment operations on one uint8 CHW image, in the worker, with torchvision's
        ops."""
        for k in range(self.layout.rounds):
            image = loader_op(image, OPS[int(row[2 * k])], float(row[2 * k + 1]))
        return image


def _erase_box(
    r: random.Random,
    height: int,
    width: int,
    min_area: float = 0.02,
    max_area: float = 1 / 3,
    min_aspect: float = 0.3,
) -> tuple[int, int, int, int] | None:
    """timm's `RandomErasing` box (one per image): (top, left, height, width), or None when 10
    attempts miss."""
    area = height * width
    log_ratio = (math.log(min_aspect), math.log(1 / min_aspect))
    for _ in range(10):
        target = r.uniform(min_area, max_area) * area
        aspect = math.exp(r.uniform(*log_ratio))
        h, w = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if w < width and h < height:
            return r.randint(0, height - h), r.randint(0, width - w), h, w
    return None


def loader_op(image: torch.Tensor, op: str, arg: float) -> torch.Tensor:
    """One operation on a uint8 CHW image with torchvision's functional ops, as its auto-augment
    policies call them (nearest interpolation, fill 0)."""
    # not at the top: the launching process's input checks import the loaders (a COCO-format set)
    # and so this module, without torchvision
    from torchvision.transforms.v2 import functional as F  # noqa: PLC0415 (torchvision: 1.5 s)

    if op == "Identity":
        return image
    if op in ("ShearX", "ShearY"):
        shear = [arg, 0.0] if op == "ShearX" else [0.0, arg]
        return F.affine(image, angle=0.0, translate=[0, 0], scale=1.0, shear=shear, center=[0, 0])
    if op in ("TranslateX", "TranslateY"):
        translate = [int(arg), 0] if op == "TranslateX" else [0, int(arg)]
        return F.affine(image, angle=0.0, translate=translate, scale=1.0, shear=[0.0, 0.0])
    if op == "Rotate":
        return F.rotate(image, angle=arg)
    colour = {
        "Brightness": F.adjust_brightness,
        "Color": F.adjust_saturation,
        "Contrast": F.adjust_contrast,
        "Sharpness": F.adjust_sharpness,
    }
    if op in colour:
        return colour[op](image, arg)
    if op == "Posterize":
        return F.posterize(image, bits=int(arg))
    if op == "Solarize":
        return F.solarize(image, threshold=arg)
    if op == "AutoContrast":
        return F.autocontrast(image)
    if op == "Equalize":
        return F.equalize(image)
    raise ValueError(f"no operation {op!r}")
