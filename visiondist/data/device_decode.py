"""JPEG decoding on the device (`data.decode_on=device`): the training loader's workers read the
file, parse its header and draw the crop and flip; the batch travels as encoded bytes; the rank
decodes it with nvJPEG, crops, resizes and flips on the GPU. A worker then costs tens of
microseconds per image instead of the ~0.7 ms of a CPU JPEG decode: what lets a few cores feed
models that decode faster than any CPU can (ViT-S on an H100).

The decoder: TorchCodec's `decode_jpeg` (PyTorch's image decoding since torchvision 0.29 deprecated
its own; the `gpu-decode` extra), else torchvision's `decode_jpeg`, which the torchvision of torch
2.11-2.15 still has. Both take a list of byte tensors and decode the batch in one nvJPEG call on
CUDA, with libjpeg-turbo on the CPU (the same library OpenCV decodes with, so that on the CPU the
device path gives the loader path's pixels; tested).

Files the device path does not take are decoded, cropped and flipped in the worker as on the loader
path and travel as pixels in the same batch: anything but an 8-bit baseline or progressive JPEG with
1 or 3 components, and JPEGs with an EXIF orientation other than upright (the decoders do not apply
it on the device). `data/decode_fallback.py` counts and lists them.

The batches are decoded one ahead of the step, on a stream of their own: `data/decode_ahead.py`.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from visiondist.data.decode import decode_rgb, exif_orientation, jpeg_frame
from visiondist.data.host import host_to

log = logging.getLogger(__name__)

# A sample's crop row: kind, top, left, height, width, flipped. Kind 1 (training): crop the box of
# the decoded image, resize it to the input size, flip; kind 2 (evaluation): resize the whole image
# to height x width, take the input size's square at top, left; kind 0: the worker decoded the file
# and the batch carries its pixels.
CROP_FIELDS = 6
CROP, RESIZE_CENTRE = 1, 2


@dataclass
class Encoded:
    """A JPEG's bytes and its size, as a worker hands it to the transform."""

    data: bytes
    height: int
    width: int


def read_encoded(path) -> Encoded | np.ndarray:
    """The file's bytes when the device can decode it (`Encoded`), else its pixels (`read_rgb`);
    OSError as `read_rgb` raises it (an empty or truncated file is as bad here as on the loader
    path)."""
    with open(path, "rb") as f:
        return encoded_or_decoded(f.read(), path)


# (name, why) of each image this process decoded itself since its last batch was collated: the batch
# carries them to the rank, which names each file once (`data.decode_fallback.FallbackCount`)
_DECODED_HERE: list[tuple[str, str]] = []


def encoded_or_decoded(data: bytes, path) -> Encoded | np.ndarray:
    """`read_encoded` of an image file's bytes (`path` names it in errors)."""
    frame = jpeg_frame(data) if data[:2] == b"\xff\xd8" and b"\xff\xd9" in data[-4096:] else None
    why = _not_for_the_device(frame, data)
    if why is not None:
        image = decode_rgb(data, path)
        _DECODED_HERE.append((str(path), why))
        return image
    assert frame is not None  # without a frame, `why` says "not a JPEG"
    return Encoded(data, frame.height, frame.width)


def _not_for_the_device(frame, data: bytes) -> str | None:
    """Why the device decoder does not take this file, or None when it does."""
    if frame is None:
        return "not a JPEG"
    if frame.precision != 8:
        return f"{frame.precision}-bit JPEG"
    if frame.components not in (1, 3):
        return (
            f"JPEG of {frame.components} components (CMYK)"
            if frame.components == 4
            else f"JPEG of {frame.components} components"
        )
    if frame.sof not in (0, 1, 2):
        return "lossless or arithmetic-coded JPEG"
    if frame.app1 and (orientation := exif_orientation(data)) != 1:
        return f"EXIF orientation {orientation}"
    return None


def decoder_name(device: torch.device | None = None) -> str:
    """Which library `decode_jpegs` decodes with on `device` here."""
    uses_torchcodec = (
        _torchcodec_decode(device.type) if device is not None else _torchcodec_import()
    )
    return "torchcodec.decoders.decode_jpeg" if uses_torchcodec else "torchvision.io.decode_jpeg"


@functools.cache
def _torchcodec_import():
    """TorchCodec's decode_jpeg, or None where it is missing or built for another torch (its import
    then raises an OSError or RuntimeError from loading its library, not an ImportError)."""
    try:
        from torchcodec.decoders import decode_jpeg  # noqa: PLC0415 (torchcodec: its extra)
    except Exception:
        return None
    return decode_jpeg


@functools.cache
def _torchcodec_decode(device_type: str):
    """TorchCodec's decode_jpeg where it decodes on this kind of device (the PyPI wheel has no CUDA
    decoder: CUDA builds come from PyTorch's index), checked once on a tiny JPEG; else None:
    torchvision's decoder is used."""
    decode_jpeg = _torchcodec_import()
    if decode_jpeg is None:
        return None
    # torchvision here and below, not at the top: the launching process's input checks import the
    # loaders (a COCO-format set) and so this module, without torchvision
    from torchvision.io import encode_jpeg  # noqa: PLC0415 (torchvision: 1.5 s)

    try:
        decode_jpeg(
            [encode_jpeg(torch.zeros(3, 8, 8, dtype=torch.uint8))], mode="RGB", device=device_type
        )
    except Exception:
        log.info(
            "TorchCodec cannot decode JPEGs on %s here: torchvision's decoder is used", device_type
        )
        return None
    return decode_jpeg


def decode_jpegs(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """RGB uint8 C, H, W tensors of a list of JPEG byte tensors, decoded on `device` (one batched
    nvJPEG call on CUDA)."""
    decode_jpeg = _torchcodec_decode(device.type)
    if decode_jpeg is None:
        from torchvision.io import ImageReadMode  # noqa: PLC0415 (torchvision: 1.5 s)
        from torchvision.io import decode_jpeg as tv_decode_jpeg  # noqa: PLC0415 (torchvision)

        # deprecated in torchvision 0.29 in favour of TorchCodec, still supported
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = tv_decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    else:
        out = decode_jpeg(data, mode="RGB", device=device)
    return list(out) if isinstance(out, (list, tuple)) else [out]


class EncodedBatch:
    """A training batch whose images are still (mostly) encoded: the JPEG bytes of every encoded
    sample in one buffer (`offsets` delimit them), the pixels of the others (`pixels`, N', S, S, C
    uint8, in batch order), and one crop row per sample (`crops`, N x 6 float64). `size` /
    `interpolation` say what the device makes of them."""

    def __init__(self, data, offsets, pixels, crops, size: int, interpolation: str):
        self.data, self.offsets, self.pixels, self.crops = data, offsets, pixels, crops
        self.size, self.interpolation = size, interpolation
        # (images, event): decoded ahead by `decode_ahead.DecodeAhead`, the event marking them done
        self.ready = None
        # (name, why) of the samples the worker decoded
        self.decoded_by_worker: list[tuple[str, str]] = []

    def __len__(self) -> int:
        return len(self.crops)

    # DataLoader's pin-memory thread calls it: the pixels are the only payload
    def pin_memory(self, device=None):
        self.pixels = self.pixels.pin_memory() if len(self.pixels) else self.pixels
        return self

    def images(self, device: torch.device) -> torch.Tensor:
        """Decode, crop, resize and flip on `device`: uint8 N, C, S, S. A batch `DecodeAhead`
        decoded already gives its images, once the current stream has waited for their event."""
        if self.ready is not None:
            images, event = self.ready
            if event is not None:
                stream = torch.cuda.current_stream(images.device)
                stream.wait_event(event)
                # its block stays out of the decoder's pool until this stream used it
                images.record_stream(stream)
            return images
        return self.decode(device)

    def decode(self, device: torch.device) -> torch.Tensor:
        """`images` on the current stream, without looking for a batch decoded ahead."""
        n, s = len(self.crops), self.size
        out = torch.empty((n, 3, s, s), dtype=torch.uint8, device=device)
        crops = self.crops.tolist()
        encoded = [i for i, c in enumerate(crops) if c[0] > 0]
        decoded = [i for i, c in enumerate(crops) if c[0] == 0]
        if decoded:
            pixels = self.pixels.to(device, non_blocking=True).permute(0, 3, 1, 2)
            out[host_to(decoded, device)] = pixels
        if encoded:
            out[host_to(encoded, device)] = self._decode_resize(encoded, crops, device)
        return out

    def _decode_resize(self, encoded: list[int], crops: list, device: torch.device) -> torch.Tensor:
        """The encoded samples decoded (one batched call), each crop resized into one float batch
        (one launch per sample), then rounded, flipped and made uint8 for the whole batch."""
        offsets = self.offsets.tolist()
        try:
            images = decode_jpegs(
                [self.data[offsets[k] : offsets[k + 1]] for k in range(len(encoded))], device
            )
        except RuntimeError as exc:
            raise RuntimeError(
                f"a JPEG could not be decoded on {device} ({exc}); its header and end marker "
                "looked valid, so the workers passed it on. data.decode_on=loader decodes in the "
                "workers, where an unreadable file is named, counted and replaced by the next "
                "image of its class"
            ) from exc
        s = self.size
        resize = (
            torch.ops.aten.upsample_bicubic2d.out
            if self.interpolation == "bicubic"
            # F.interpolate's kernels, writing into the batch
            else torch.ops.aten.upsample_bilinear2d.out
        )
        resized = torch.empty((len(encoded), 3, s, s), dtype=torch.float32, device=device)
        flipped = []
        for j, (i, image) in enumerate(zip(encoded, images)):
            kind, top, left, h, w, flip = (int(v) for v in crops[i])
            # as the eval transform: the whole image resized, then the centre crop
            if kind == RESIZE_CENTRE:
                whole = resize(
                    image[None].float(),
                    [h, w],
                    False,
                    None,
                    None,
                    out=torch.empty((1, 3, h, w), dtype=torch.float32, device=device),
                )
                resized[j] = whole[0, :, top : top + s, left : left + s]
                continue
            resize(
                image[None, :, top : top + h, left : left + w].float(),
                [s, s],
                False,
                None,
                None,
                out=resized[j : j + 1],
            )
            if flip:
                flipped.append(j)
        if flipped:
            where = host_to(flipped, device)
            resized[where] = resized[where].flip(-1)
        return resized.round_().clamp_(0, 255).to(torch.uint8)


class collate_encoded:
    """The train loader's collate under `data.decode_on=device`: (image or bytes, label, row)
    samples -> (EncodedBatch, labels[, augmentation rows]); a row is the crop row, then the sample's
    augmentation row if any."""

    def __init__(self, size: int, interpolation: str):
        self.size, self.interpolation = size, interpolation

    def __call__(self, samples):
        images, labels, rows = zip(*samples)
        rows = torch.stack(rows)
        flags = rows[:, 0].tolist()
        encoded = [x for x, f in zip(images, flags) if f > 0]
        pixels = [x for x, f in zip(images, flags) if f == 0]
        sizes = [len(x) for x in encoded]
        offsets = torch.tensor(
            np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]) if sizes else [0]
        )
        data = torch.cat(encoded) if encoded else torch.empty(0, dtype=torch.uint8)
        stacked = (
            torch.stack(pixels)
            if pixels
            else torch.empty((0, self.size, self.size, 3), dtype=torch.uint8)
        )
        batch = EncodedBatch(
            data,
            offsets,
            stacked,
            rows[:, :CROP_FIELDS].contiguous(),
            self.size,
            self.interpolation,
        )
        # this batch's: a worker reads a whole batch, then collates it
        batch.decoded_by_worker = _DECODED_HERE[:]
        _DECODED_HERE.clear()
        labels = torch.tensor(labels, dtype=torch.int64)
        if rows.shape[1] > CROP_FIELDS:
            return batch, labels, rows[:, CROP_FIELDS:].contiguous()
        return batch, labels
