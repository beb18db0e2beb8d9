"""The auto-augment operations and random erasing on a whole uint8 / float batch on the device, with
one parameter per sample: what `visiondist.data.augment` applies after the copy.

Each operation follows torchvision's tensor kernel step by step (the same float32 arithmetic, grid
and rounding), with the scalar argument replaced by a per-sample column, so that a sample comes out
as torchvision's op makes it in a worker (tests/unit/test_augment.py states the bound). The samples
that drew an operation go through it together: at most 14 calls per round whatever the batch size.
Parameter rows stay on the host (grouping needs no device sync); only the per-sample arguments
travel.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.transforms.v2 import functional as TF

from visiondist.data.augment import OPS, AugmentParams, AugmentPolicy
from visiondist.data.host import host_to
from visiondist.data.transforms import to_device


def apply_operations(
    images: torch.Tensor, rows: torch.Tensor, layout: AugmentParams
) -> torch.Tensor:
    """`layout.rounds` rounds of auto-augmentation on uint8 `images` (N, C, H, W) by the host rows
    (N, width).

    Per round, the samples are gathered in the order of the operation they drew (one gather, one
    pinned copy of the order and the arguments), each operation works in place on its contiguous
    slice, and one scatter puts them back: a fixed number of launches per operation whatever the
    batch size, and no host-device synchronisation."""
    table = rows.detach().cpu().double().numpy()
    for k in range(layout.rounds):
        ops, args = table[:, 2 * k].astype(np.int64), table[:, 2 * k + 1]
        order = np.argsort(ops, kind="stable")
        ops, args = ops[order], args[order]
        groups = [(op, s, e) for op, s, e in _runs(ops) if OPS[op] != "Identity"]
        if not groups:
            continue
        # (2, N) float64: exact
        moved = host_to(np.stack([order.astype(np.float64), args]), images.device)
        where, device_args = moved[0].long(), moved[1]
        work = images[where]
        for op, s, e in groups:
            work[s:e] = _OPERATIONS[OPS[op]](work[s:e], device_args[s:e], args[s:e])
        images[where] = work
    return images


def _runs(sorted_values: np.ndarray):
    """(value, start, end) of each run of equal values."""
    edges = np.flatnonzero(np.diff(sorted_values)) + 1
    starts = np.concatenate([[0], edges]).astype(int)
    ends = np.concatenate([edges, [len(sorted_values)]]).astype(int)
    return [(int(sorted_values[s]), int(s), int(e)) for s, e in zip(starts, ends)]


def _column(values: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return values.to(dtype).view(-1, 1, 1, 1)


def _blend(image: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """torchvision's `_blend` with a ratio per sample: ratio * image + (1 - ratio) * other, clamped,
    back to uint8. (1 - ratio) is taken in double and rounded once, as torchvision's scalar alpha
    is."""
    return (
        torch.addcmul(image.float().mul_(_column(ratio)), other, _column(1.0 - ratio))
        .clamp_(0, 255)
        .to(torch.uint8)
    )


def _grey_floor(image: torch.Tensor) -> torch.Tensor:
    r, g, b = image.unbind(dim=-3)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).unsqueeze(-3).floor_()


def _brightness(image, factor, _):
    return image.float().mul_(_column(factor)).clamp_(0, 255).to(torch.uint8)


def _saturation(image, factor, _):
    return _blend(image, _grey_floor(image), factor)


def _contrast(image, factor, _):
    return _blend(image, _grey_floor(image).mean(dim=(-3, -2, -1), keepdim=True), factor)


def _sharpness(image, factor, _):
    c, h, w = image.shape[-3:]
    if h <= 2 or w <= 2:
        return image
    kernel = torch.full((3, 3), 1.0 / 13.0, dtype=torch.float32, device=image.device)
    # a fill, not an item assignment: that copies a host scalar and synchronises
    kernel[1:2, 1:2].fill_(5.0 / 13.0)
    out = image.to(torch.float32, copy=True)
    blurred = F.conv2d(out, kernel.expand(c, 1, 3, 3), groups=c).round_()
    view = out[..., 1:-1, 1:-1]
    view.add_(blurred.sub_(view).mul_(_column(1.0 - factor)))
    return out.clamp_(0, 255).to(torch.uint8)


def _posterize(image, bits, _):
    bits = bits.long().clamp(0, 8)
    mask = (((1 << bits) - 1) << (8 - bits)).to(torch.uint8)
    return image & _column(mask, torch.uint8)


def _solarize(image, threshold, _):
    return torch.where(image >= _column(threshold), 255 - image, image)


def _autocontrast(image, *_):
    return TF.autocontrast(image)


def _equalize(image, *_):
    return TF.equalize(image)


def _inverse_affine(center, angle, translate, shear) -> list[float]:
    """torchvision's inverse affine matrix (scale 1) in pixel units about `center` (relative to the
    image centre)."""
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
    """Nearest-neighbour resampling by one inverse matrix per sample, fill 0: torchvision's
    `_affine_grid` and `_apply_grid_transform`, batched."""
    n, _, h, w = image.shape
    theta = host_to(np.asarray(matrices, dtype=np.float32), image.device).view(n, 2, 3)
    base = torch.empty(1, h, w, 3, dtype=torch.float32, device=image.device)
    base[..., 0].copy_(
        torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=image.device)
    )
    base[..., 1].copy_(
        torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=image.device).unsqueeze_(
            -1
        )
    )
    base[..., 2].fill_(1)
    scaled = theta.transpose(1, 2).contiguous()
    scaled[..., 0].div_(0.5 * w)
    scaled[..., 1].div_(0.5 * h)
    grid = base.view(1, h * w, 3).expand(n, -1, -1).bmm(scaled).view(n, h, w, 2)
    out = F.grid_sample(
        image.float(), grid, mode="nearest", padding_mode="zeros", align_corners=False
    )
    return out.round_().to(torch.uint8)


def _geometry(name: str):
    def op(image: torch.Tensor, _, args: np.ndarray) -> torch.Tensor:
        """All samples warped at once (an angle of 0 is the identity matrix: nearest resampling
        returns the pixels); a quarter turn of a square image is torchvision's exact rot90 fast
        path, one sample at a time (a policy's magnitudes never draw one)."""
        h, w = image.shape[-2:]
        matrices, turned = [], []
        for i, arg in enumerate(args.tolist()):
            if name == "Rotate":
                angle = arg % 360
                turns = {90: 1, 180: 2, 270: 3} if h == w else {180: 2}
                if angle in turns:
                    turned.append((i, turns[angle]))
                matrices.append(_inverse_affine([0.0, 0.0], -angle, [0.0, 0.0], [0.0, 0.0]))
            elif name in ("ShearX", "ShearY"):
                shear = [arg, 0.0] if name == "ShearX" else [0.0, arg]
                matrices.append(_inverse_affine([-w * 0.5, -h * 0.5], 0.0, [0.0, 0.0], shear))
            else:
                shift = [float(int(arg)), 0.0] if name == "TranslateX" else [0.0, float(int(arg))]
                matrices.append(_inverse_affine([0.0, 0.0], 0.0, shift, [0.0, 0.0]))
        out = _warp(image, matrices)
        for i, k in turned:
            out[i] = torch.rot90(image[i], k=k, dims=(-2, -1))
        return out

    return op


_OPERATIONS = {
    "Brightness": _brightness,
    "Color": _saturation,
    "Contrast": _contrast,
    "Sharpness": _sharpness,
    "Posterize": _posterize,
    "Solarize": _solarize,
    "AutoContrast": _autocontrast,
    "Equalize": _equalize,
    **{
        name: _geometry(name) for name in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
    },
}


class DeviceAugment:
    """The device's part of the training augmentation (`visiondist.data.augment`): the auto-augment
    operations on the uint8 batch after the copy (`data.augment_on=device`), then, after
    normalisation, random erasing."""

    def __init__(self, d, img_size: int):
        self.policy = AugmentPolicy.from_config(d, img_size)
        self.operations = d.augment_on == "device" and self.policy.layout.rounds > 0

    def __call__(
        self, images: torch.Tensor, rows: torch.Tensor, device: torch.device, normalize
    ) -> torch.Tensor:
        """uint8 N, H, W, C loader images and their parameter rows -> the normalised, augmented
        model input."""
        images = to_device(images, device)  # a new tensor: the ops below work in place
        if self.operations:
            images = apply_operations(images, rows, self.policy.layout)
        images = normalize.normalize(images)
        if self.policy.erase_p > 0:
            # a new tensor: Normalize's
            images = erase(images, rows, self.policy.layout, self.policy.erase_mode)
        return images


# -- random erasing --------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 values in [0, 2^32), in int64 arithmetic: the same
    bits on every device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _normal(counter: torch.Tensor, n, key) -> torch.Tensor:
    """Box-Muller on the hashes of counters `counter` and `counter + n` (offset by `key`): element
    `counter` of `hash_normal`'s n values."""
    u1 = (_hash32((counter + key) & _M32).double() + 0.5) / 2.0**32
    u2 = (_hash32((counter + n + key) & _M32).double() + 0.5) / 2.0**32
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)).float()


def hash_normal(seed: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Standard-normal noise of `shape` that is a function of `seed` only (counter-based: a hash of
    (seed, element) and Box-Muller), so that an erased box holds the same noise on any rank and in
    any batch."""
    n = math.prod(shape)
    key = int(_hash32(torch.tensor([seed & _M32])).item())
    return _normal(torch.arange(n, device=device, dtype=torch.int64), n, key).view(shape)


def erase(
    images: torch.Tensor, rows: torch.Tensor, layout: AugmentParams, mode: str
) -> torch.Tensor:
    """timm's random erasing on normalised float `images` (N, C, H, W), in place, by the host rows:
    each erased sample's box filled with per-pixel normal noise (`pixel`), one normal colour
    (`rand`) or zeros (`const`); the noise of a box is `hash_normal(seed, box shape)`. The erased
    samples are done together, in chunks of about 8 M values (one pinned copy of their boxes each,
    no host-device synchronisation)."""
    box = rows.detach().cpu()[:, layout.erase_slice()].double().numpy()
    picked = np.flatnonzero(box[:, 0] > 0)
    c, height, width = images.shape[1:]
    chunk = max(1, 2**23 // (c * height * width))
    for s in range(0, len(picked), chunk):
        index = picked[s : s + chunk]
        top, left, h, w, seed = box[index, 1:6].astype(np.int64).T
        keys = _hash32(torch.from_numpy(seed & _M32)).numpy()
        params = host_to(np.stack([index, top, left, h, w, keys]), images.device).view(
            6, -1, 1, 1, 1
        )
        where, top, left, h, w, key = params
        ys = torch.arange(height, device=images.device).view(1, 1, -1, 1)
        xs = torch.arange(width, device=images.device).view(1, 1, 1, -1)
        inside = (ys >= top) & (ys < top + h) & (xs >= left) & (xs < left + w)
        channel = torch.arange(c, device=images.device).view(1, -1, 1, 1)
        if mode == "pixel":
            fill = _normal((channel * h + ys - top) * w + xs - left, c * h * w, key)
        elif mode == "rand":
            fill = _normal(channel, c, key)
        else:
            fill = torch.zeros((), device=images.device)
        where = where.view(-1)
        images[where] = torch.where(inside, fill.to(images.dtype), images[where])
    return images
