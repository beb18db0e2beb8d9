"""How much of the hardware a training rate uses: model FLOPs utilisation (MFU) and the GPU memory
peak."""

from __future__ import annotations

from typing import Optional

import torch
from omegaconf import DictConfig

from visiondist.models.flops import classifier_train_flops
from visiondist.parallel import Layout
from visiondist.utils.peaks import datasheet_tflops, peak_kind


class Utilisation:
    """`mfu(images_per_s)` of this run's model on this rank's device, and `peak_gpu_gib()`."""

    def __init__(self, cfg: DictConfig, layout: Layout):
        self.cfg, self.layout = cfg, layout
        # (datasheet FLOP/s, training FLOPs per image)
        self._peak: Optional[tuple[float, float]] = None

    def mfu(self, images_per_s: float) -> Optional[float]:
        """Model FLOPs utilisation of a training rate (images/s of the whole job): the model's
        training FLOPs per image (counted once) times the rate per device, over the device's dense
        datasheet peak in the step's matmul precision. None on the CPU, on a GPU the datasheet table
        does not know, and for detectors and native-resolution ViTs (their FLOPs change with each
        image's size)."""
        device, cfg = self.layout.device, self.cfg
        if (
            device.type != "cuda"
            or cfg.model.family != "vit"
            or cfg.data.get("resolution") == "native"
        ):
            return None
        if self._peak is None:
            t = cfg.trainer
            peak = datasheet_tflops(
                torch.cuda.get_device_name(device), peak_kind(t.precision, t.tf32, device)
            )
            self._peak = (peak * 1e12, classifier_train_flops(cfg.model)) if peak else (0.0, 0.0)
        peak, per_image = self._peak
        return per_image * images_per_s / self.layout.world_size / peak if peak else None

    def peak_gpu_gib(self) -> Optional[float]:
        """The most tensor memory this rank's GPU has held so far (None on the CPU)."""
        device = self.layout.device
        return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
