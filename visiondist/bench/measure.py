"""What the benchmark measures with: step timing on the device's stream, peak memory, FLOPs per
image, the device's name, the loader's own rate, and synthetic batches that already sit on the
device.

A classifier's benchmark and the dry run (which takes its synthetic batches) never import
torchvision's detectors, and torch._dynamo with them (1.5 s): `# noqa: PLC0415 (detector-side)`."""

from __future__ import annotations

import gc
import platform
import random
import resource
import time
from pathlib import Path
from typing import Any, Callable, Optional

import cv2
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from visiondist.data.augment import AugmentPolicy
from visiondist.data.device_decode import CROP_FIELDS, EncodedBatch, collate_encoded
from visiondist.models import build_model
from visiondist.models.flops import classifier_train_flops
from visiondist.utils.clock import DeviceClock

# -- timing and memory -----------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopped(Exception):
    """A stop signal (SIGINT / SIGTERM) reached the benchmark: it ends after the step in flight,
    recording nothing."""


def time_steps(
    step: Callable[[], Any], n: int, device: torch.device, stop: Optional[Callable[[], bool]] = None
) -> list[float]:
    """Seconds of each of `n` calls on the device (`DeviceClock`: CUDA events on the current
    stream), the device drained before the first and after the last call but not between them: the
    host queues a step while the device runs the one before, as in training, so that a step's figure
    is the training log's (a host-timed step with the device drained around it also counts the
    launch gap at its start). `stop()` true after a call raises `Stopped`."""
    synchronize(device)
    clocks = []
    for _ in range(n):
        clock = DeviceClock(device)
        clock.start()
        step()
        clock.stop()
        clocks.append(clock)
        if stop is not None and stop():
            synchronize(device)
            raise Stopped
    synchronize(device)
    return [clock.seconds() for clock in clocks]


def train_flops_per_image(model_cfg: DictConfig, batch: tuple, family: str) -> float:
    """FLOPs of one forward + backward per image: a classifier's counted on the meta device (costing
    nothing, `classifier_train_flops`), a detector's on the CPU on the batch's first image, since
    its box sampling needs real values."""
    if family == "classification":
        return classifier_train_flops(model_cfg)
    # the run's config is read-only
    cfg = OmegaConf.merge(model_cfg, {"weights": None, "init_from": None})
    images, targets = batch
    model = build_model(cfg).train()
    with FlopCounterMode(display=False) as counter:
        losses = model(
            [images[0].cpu().float() / 255], [{k: v.cpu() for k, v in targets[0].items()}]
        )
        sum(losses.values()).backward()
    return float(counter.get_total_flops())


class PeakMemory:
    """CUDA: the peak of tensor memory since construction, above what was allocated then (what one
    configuration adds to a process that may hold others). The allocator's cache is emptied first:
    blocks an earlier configuration left cached would otherwise serve this one's and hide its
    reservation. The CPU has no such counter: `rss_gb` is the whole process's peak."""

    def __init__(self, device: torch.device):
        self.device = device
        self.before = self.reserved_before = 0
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            self.before = torch.cuda.memory_allocated(device)
            self.reserved_before = torch.cuda.memory_reserved(device)
            torch.cuda.reset_peak_memory_stats(device)

    def increase_gb(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return (torch.cuda.max_memory_allocated(self.device) - self.before) / 1e9

    def reserved_gb(self) -> float | None:
        """The caching allocator's peak reservation above what it held before (what the device must
        have free)."""
        if self.device.type != "cuda":
            return None
        return (torch.cuda.max_memory_reserved(self.device) - self.reserved_before) / 1e9

    @staticmethod
    def rss_gb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU ({model}), {torch.get_num_threads()} threads"


def loader_images_per_s(loader, batches: int) -> float:
    """Images per second the real train loader delivers on its own (after its first batch: worker
    start-up)."""
    it = iter(loader)
    next(it)
    start, images = time.perf_counter(), 0
    for _ in range(batches):
        try:
            batch = next(it)
        except StopIteration:
            break
        images += len(batch[0]) if batch[0] is not None else len(batch[1])
    return images / max(time.perf_counter() - start, 1e-9)


# -- synthetic batches -----------------------------------------------------------------------------


def synthetic_batch(
    cfg: DictConfig, family: str, micro_batch: int, device: torch.device, seed: int = 0
) -> tuple:
    """One micro-batch of random images and targets at the model's input size, on `device`; the
    images uint8, as the loaders yield them (the step normalises them on the device). What the
    configuration does on the device comes with it, so that the step times it: each sample's
    augmentation row (`data.augment_on=device`, random erasing), and under `data.decode_on=device`
    the images as JPEGs of 1.5x the input size (`device_input_work`)."""
    g = torch.Generator().manual_seed(seed)
    if family == "classification":
        size = cfg.model.img_size
        # as loaders
        images = torch.randint(0, 256, (micro_batch, size, size, 3), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, cfg.model.num_classes, (micro_batch,), generator=g)
        d = cfg.data
        images = (
            _jpegs(micro_batch, size, seed, d)
            if d.get("decode_on", "loader") == "device"
            else images.to(device)
        )
        rows = _augment_rows(micro_batch, size, seed, d)
        return (images, labels.to(device)) if rows is None else (images, labels.to(device), rows)
    from visiondist.models.detection import has_masks  # noqa: PLC0415 (detector-side)

    # torchvision's detectors resize internally: square images of the short side; a DETR-class
    # detector takes its own square input, model.img_size, which the loader's square images have
    # (and the library's plain loop takes)
    size = cfg.model.img_size if cfg.model.get("family") == "detr" else cfg.data.min_size
    masks = has_masks(cfg.model)  # Mask R-CNN: each object's mask fills its box
    pictures: list[torch.Tensor] = []
    targets: list[dict[str, torch.Tensor]] = []
    for _ in range(micro_batch):
        pictures.append(
            torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=g).to(device)
        )
        n = int(torch.randint(1, 5, (), generator=g))
        xy = torch.rand(n, 2, generator=g) * size * 0.6
        wh = torch.rand(n, 2, generator=g) * size * 0.3 + size * 0.05
        boxes = torch.cat([xy, xy + wh], dim=1)
        labels = torch.randint(1, cfg.model.num_classes + 1, (n,), generator=g)
        targets.append({"boxes": boxes.to(device), "labels": labels.to(device)})
        if masks:
            fill = torch.zeros(n, size, size, dtype=torch.uint8)
            for k, (x1, y1, x2, y2) in enumerate(boxes.round().int().tolist()):
                fill[k, y1:y2, x1:x2] = 1
            targets[-1]["masks"] = fill.to(device)
    return pictures, targets


def decoded_batch(batch, device: torch.device):
    """`batch` with its JPEGs (`data.decode_on=device`) decoded once, as H, W, C pixels on `device`,
    as a loader that decodes in its workers gives them; other batches as they are. What the plain
    loops step on."""
    if not isinstance(batch, tuple) or not isinstance(batch[0], EncodedBatch):
        return batch
    images = batch[0].decode(device).permute(0, 2, 3, 1).contiguous()
    synchronize(device)
    return (images, *batch[1:])


def device_input_work(d: DictConfig) -> list[str]:
    """What a classification step does to its input on the device under the data config `d`, beyond
    normalising."""
    work = ["JPEG decode + crop + resize"] if d.get("decode_on", "loader") == "device" else []
    if d.get("auto_augment", "none") != "none" and d.get("augment_on", "device") == "device":
        work.append(f"auto-augment ({d.auto_augment})")
    if d.get("random_erasing", 0) > 0:
        work.append("random erasing")
    return work


def _augment_rows(n: int, size: int, seed: int, d: DictConfig) -> torch.Tensor | None:
    policy = AugmentPolicy.from_config(d, size)
    if not policy.active:
        return None
    return torch.from_numpy(
        np.stack([policy.draw(random.Random(seed * 1_000_003 + i)) for i in range(n)])
    )


def _jpegs(n: int, size: int, seed: int, d: DictConfig):
    """n photo-like JPEGs (smooth colour fields and noise, quality 90) of 1.5x `size`, as
    `data.decode_on=device`'s workers hand them over: each cropped whole and resized to `size` on
    the device."""
    rng, side = np.random.default_rng(seed), size * 3 // 2
    samples = []
    for _ in range(n):
        low = cv2.resize(rng.uniform(0, 255, (6, 6, 3)).astype(np.float32), (side, side))
        image = np.clip(low + rng.normal(0, 8, low.shape), 0, 255).astype(np.uint8)
        data = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])[1]
        row = torch.zeros(CROP_FIELDS, dtype=torch.float64)
        row[:5] = torch.tensor([1, 0, 0, side, side], dtype=torch.float64)
        samples.append((torch.from_numpy(data.reshape(-1).copy()), 0, row))
    return collate_encoded(size, d.get("interpolation", "bilinear"))(samples)[0]
