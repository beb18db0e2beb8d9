"""The auto-augment operations and random erasing on a whole uint8 / float batch on the device, with one parameter
per sample: what `visiondist.data.augment` applies after the copy.

Each operation follows torchvision's tensor kernel step by step (the same float32 arithmetic, grid and rounding), with
the scalar argument replaced by a per-sample column, so that a sample comes out as torchvision's op makes it in a
worker (tests/unit/test_augment.py states the bound). The samples that drew an operation go through it together: at
most 14 calls per round whatever the batch size. Parameter rows stay on the host (grouping needs no device sync);
only the per-sample arguments travel.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from visiondist.data.augment import OPS, AugmentParams, AugmentPolicy


def apply_operations(images: torch.Tensor, rows: torch.Tensor, layout: AugmentParams) -> torch.Tensor:
    """`layout.rounds` rounds of auto-augmentation on uint8 `images` (N, C, H, W) by the host rows (N, width)."""
    rows = rows.detach().cpu().double()
    for k in range(layout.rounds):
        ops, args = rows[:, 2 * k].long(), rows[:, 2 * k + 1]
        for op in ops.unique().tolist():
            name = OPS[op]
            if name == "Identity":
                continue
            picked = (ops == op).nonzero().flatten()
            where = picked.to(images.device, non_blocking=True)
            images[where] = _OPERATIONS[name](images[where], args[picked])
    return images


def _column(values: torch.Tensor, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    return values.to(dtype).view(-1, 1, 1, 1).to(device, non_blocking=True)


def _blend(image: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """torchvision's `_blend` with a ratio per sample: ratio * image + (1 - ratio) * other, clamped, back to uint8.
    (1 - ratio) is taken in double and rounded once, as torchvision's scalar alpha is."""
    r, rest = _column(ratio, image.device), _column(1.0 - ratio, image.device)
    return torch.addcmul(image.float().mul_(r), other, rest).clamp_(0, 255).to(torch.uint8)


def _grey_floor(image: torch.Tensor) -> torch.Tensor:
    r, g, b = image.unbind(dim=-3)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(-3).floor_()


def _brightness(image, factor):
    return image.float().mul_(_column(factor, image.device)).clamp_(0, 255).to(torch.uint8)


def _saturation(image, factor):
    return _blend(image, _grey_floor(image), factor)


def _contrast(image, factor):
    return _blend(image, _grey_floor(image).mean(dim=(-3, -2, -1), keepdim=True), factor)


def _sharpness(image, factor):
    c, h, w = image.shape[-3:]
    if h <= 2 or w <= 2:
        return image
    a, b = 1.0 / 13.0, 5.0 / 13.0
    kernel = torch.tensor([[a, a, a], [a, b, a], [a, a, a]], dtype=torch.float32, device=image.device)
    out = image.to(torch.float32, copy=True)
    blurred = F.conv2d(out, kernel.expand(c, 1, 3, 3), groups=c).round_()
    view = out[..., 1:-1, 1:-1]
    view.add_(blurred.sub_(view).mul_(_column(1.0 - factor, image.device)))
    return out.clamp_(0, 255).to(torch.uint8)


def _posterize(image, bits):
    bits = bits.long().clamp(0, 8)
    mask = (((1 << bits) - 1) << (8 - bits)).to(torch.uint8)
    return image & _column(mask, image.device, torch.uint8)


def _solarize(image, threshold):
    return torch.where(image >= _column(threshold, image.device), 255 - image, image)


def _autocontrast(image, _):
    from torchvision.transforms.v2 import functional as TF

    return TF.autocontrast(image)


def _equalize(image, _):
    from torchvision.transforms.v2 import functional as TF

    return TF.equalize(image)


def _inverse_affine(center, angle, translate, shear) -> list[float]:
    """torchvision's inverse affine matrix (scale 1) in pixel units about `center` (relative to the image centre)."""
    rot, sx, sy = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    (cx, cy), (tx, ty) = center, translate
    a = math.cos(rot - sy) / math.cos(sy)
    b = -(a * math.tan(sx) + math.sin(rot))
    c = math.sin(rot - sy) / math.cos(sy)
    d = math.cos(rot) - c * math.tan(sx)
    m = [d, -b, 0.0, -c, a, 0.0]
    m[2] += cx - m[0] * (cx + tx) - m[1] * (cy + ty)
    m[5] += cy - m[3] * (cx + tx) - m[4] * (cy + ty)
    return m


def _warp(image: torch.Tensor, matrices: list[list[float]]) -> torch.Tensor:
    """Nearest-neighbour resampling by one inverse matrix per sample, fill 0: torchvision's `_affine_grid` and
    `_apply_grid_transform`, batched."""
    n, _, h, w = image.shape
    theta = torch.tensor(matrices, dtype=torch.float32).view(n, 2, 3).to(image.device, non_blocking=True)
    base = torch.empty(1, h, w, 3, dtype=torch.float32, device=image.device)
    base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=image.device))
    base[..., 1].copy_(torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=image.device).unsqueeze_(-1))
    base[..., 2].fill_(1)
    scaled = theta.transpose(1, 2).div_(torch.tensor([0.5 * w, 0.5 * h], device=image.device))
    grid = base.view(1, h * w, 3).expand(n, -1, -1).bmm(scaled).view(n, h, w, 2)
    out = F.grid_sample(image.float(), grid, mode="nearest", padding_mode="zeros", align_corners=False)
    return out.round_().to(torch.uint8)


def _geometry(name: str):
    def op(image: torch.Tensor, args: torch.Tensor) -> torch.Tensor:
        h, w = image.shape[-2:]
        out = image.clone()
        matrices, warped = [], []
        for i, arg in enumerate(args.tolist()):
            if name == "Rotate":
                angle = arg % 360
                turns = {0: 0, 180: 2, 90: 1, 270: 3} if h == w else {0: 0, 180: 2}
                if angle in turns:  # torchvision's exact fast paths
                    out[i] = torch.rot90(image[i], k=turns[angle], dims=(-2, -1))
                    continue
                matrices.append(_inverse_affine([0.0, 0.0], -angle, [0.0, 0.0], [0.0, 0.0]))
            elif name in ("ShearX", "ShearY"):
                shear = [arg, 0.0] if name == "ShearX" else [0.0, arg]
                matrices.append(_inverse_affine([-w * 0.5, -h * 0.5], 0.0, [0.0, 0.0], shear))
            else:
                shift = [float(int(arg)), 0.0] if name == "TranslateX" else [0.0, float(int(arg))]
                matrices.append(_inverse_affine([0.0, 0.0], 0.0, shift, [0.0, 0.0]))
            warped.append(i)
        if warped:
            where = torch.tensor(warped, device=image.device)
            out[where] = _warp(image[where], matrices)
        return out
    return op


_OPERATIONS = {"Brightness": _brightness, "Color": _saturation, "Contrast": _contrast, "Sharpness": _sharpness,
               "Posterize": _posterize, "Solarize": _solarize, "AutoContrast": _autocontrast, "Equalize": _equalize,
               **{name: _geometry(name) for name in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")}}


class DeviceAugment:
    """The device's part of the training augmentation (`visiondist.data.augment`): the auto-augment operations on the
    uint8 batch after the copy (`data.augment_on=device`), then, after normalisation, random erasing."""

    def __init__(self, d, img_size: int):
        self.policy = AugmentPolicy.from_config(d, img_size)
        self.operations = d.augment_on == "device" and self.policy.layout.rounds > 0

    def __call__(self, images: torch.Tensor, rows: torch.Tensor, device: torch.device, normalize) -> torch.Tensor:
        """uint8 N, H, W, C loader images and their parameter rows -> the normalised, augmented model input."""
        from visiondist.data.transforms import to_device

        images = to_device(images, device)  # a new tensor: the ops below work in place
        if self.operations:
            images = apply_operations(images, rows, self.policy.layout)
        images = normalize.normalize(images)
        if self.policy.erase_p > 0:
            images = erase(images, rows, self.policy.layout, self.policy.erase_mode)  # a new tensor: Normalize's
        return images


# -- random erasing ------------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 values in [0, 2^32), in int64 arithmetic: the same bits on every
    device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hash_normal(seed: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Standard-normal noise of `shape` that is a function of `seed` only (counter-based: a hash of (seed, element)
    and Box-Muller), so that an erased box holds the same noise on any rank and in any batch."""
    n = math.prod(shape)
    counter = torch.arange(2 * n, device=device, dtype=torch.int64)
    key = int(_hash32(torch.tensor([seed & _M32])).item())
    bits = _hash32((counter + key) & _M32)
    u = (bits.double() + 0.5) / 2.0 ** 32
    u1, u2 = u[:n], u[n:]
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).float().view(shape)


def erase(images: torch.Tensor, rows: torch.Tensor, layout: AugmentParams, mode: str) -> torch.Tensor:
    """timm's random erasing on normalised float `images` (N, C, H, W), in place, by the host rows: each erased
    sample's box filled with per-pixel normal noise (`pixel`), one normal colour (`rand`) or zeros (`const`)."""
    box = rows.detach().cpu()[:, layout.erase_slice()].double().numpy()
    c = images.shape[1]
    for i in np.flatnonzero(box[:, 0] > 0).tolist():
        _, top, left, h, w, seed = (int(v) for v in box[i])
        patch = images[i, :, top:top + h, left:left + w]
        if mode == "pixel":
            patch.copy_(hash_normal(seed, (c, h, w), images.device))
        elif mode == "rand":
            patch.copy_(hash_normal(seed, (c, 1, 1), images.device).expand(c, h, w))
        else:
            patch.zero_()
    return images
