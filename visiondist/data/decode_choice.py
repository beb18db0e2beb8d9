"""`data.decode_on=auto`: where a run's training JPEGs are decoded, chosen before the ranks start.

Decoding on the device (nvJPEG, `data.decode_on=device`) frees the loader workers of the decode
(~760 us of ~900 per image) but takes GPU time from the step: its device side ran 12,236 images/s on
an H200, 21% of a ViT-B/16 step's time at 2,750 images/s. The workers deliver ~1,000 images/s per
core on the DeiT path (1,091 on a 2-core EPYC, 1,020 on an H100 host's 15 workers). So the device
wins only where the workers cannot feed the step, and then by what the step pays for decoding:

    step     = 35% of the GPU's datasheet peak / the model's training FLOPs per image
               (ViT-B/16 DeiT ran 34.4%)
    loader   = min(step, workers x 1,000)
    device   = 1 / (1 / step + 1 / 12,000)

auto decodes on the device when `device` > 1.05 x `loader` (on an H100: a ViT-S/16 fed by 5 workers
or fewer, a ViT-B/16 by 2 or fewer); in the loader otherwise, on the CPU, for data it cannot decode
on the device (COCO, augmentation in the workers) and where the rates are unknown (a GPU the peak
table does not know, a model without a FLOP count). One line before the ranks start says the choice
and the figures.
"""

from __future__ import annotations

from typing import Optional

import torch
from omegaconf import DictConfig

from visiondist.config.layout import RunLayout
from visiondist.data.workers import loader_workers
from visiondist.models.flops import vit_train_flops
from visiondist.models.registry import spec_of
from visiondist.utils.peaks import datasheet_tflops
from visiondist.utils.procenv import ranks_sharing_cpus

# per loader worker (one core), the DeiT path with the decode (RESULTS: per CPU core)
WORKER_IMAGES_PER_S = 1_000
# decode + crop + resize + flip on the device (RESULTS: an H200)
DEVICE_DECODE_IMAGES_PER_S = 12_000
# of the datasheet's peak, for the step's rate before it runs (ViT-B/16 DeiT: 34.4% on an H100)
ASSUMED_MFU = 0.35
MARGIN = 1.05


def decode_plan(cfg: DictConfig, run: RunLayout, gpu_name: Optional[str] = None) -> tuple[str, str]:
    """("loader" or "device", why) for `data.decode_on`: as asked, or auto's choice (the module's
    rule)."""
    d = cfg.data
    asked = str(d.get("decode_on", "loader"))
    if asked != "auto":
        return asked, f"data.decode_on={asked}"
    if d.get("format") not in ("imagefolder", "shards") or cfg.model.family != "vit":
        return (
            "loader",
            f"data.format={d.get('format')} with {cfg.model.name}: decoded in the loader workers",
        )
    if d.get("augment_on", "device") == "loader" and d.get("auto_augment", "none") != "none":
        return "loader", "data.augment_on=loader augments decoded images in the workers"
    if d.get("resolution", "square") == "native":
        return "loader", "data.resolution=native resizes each image to its own grid in the workers"
    if run.accelerator != "cuda":
        return "loader", "on the CPU the rank would decode what its workers decode now"

    shape = spec_of(cfg.model).planner_shape
    peak = datasheet_tflops(
        gpu_name or _gpu_name(), "bf16" if str(cfg.trainer.precision) == "bf16" else "tf32"
    )
    if shape is None or peak is None:
        return (
            "loader",
            "the step's rate is unknown here (no datasheet peak or FLOP count): decoded in the "
            "workers",
        )
    workers = loader_workers(int(d.num_workers), ranks_sharing_cpus(run.per_node))
    step = ASSUMED_MFU * peak * 1e12 / vit_train_flops(shape(cfg.model))
    loader = min(step, workers * WORKER_IMAGES_PER_S)
    device = 1.0 / (1.0 / step + 1.0 / DEVICE_DECODE_IMAGES_PER_S)
    figures = (
        f"the step ~{step:,.0f} images/s per GPU at {ASSUMED_MFU:.0%} MFU; {workers} loader "
        f"worker{'s' if workers != 1 else ''} ~{workers * WORKER_IMAGES_PER_S:,} images/s; "
        f"decoding on the device ~{device:,.0f} images/s with the step"
    )
    if device > MARGIN * loader:
        return (
            "device",
            f"decoded on the device (nvJPEG): the workers cannot feed the step ({figures})",
        )
    return (
        "loader",
        "decoded in the loader workers, which keep up or lose less than the device's decode "
        f"({figures})",
    )


def _gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
