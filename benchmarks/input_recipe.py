"""The training input every data benchmark measures: 224 px crops in batches of 64, and the
classification recipe's data config (`recipe_cfg`). Shared by `data_throughput.py` (the CPU side),
`data_throughput_gpu.py` (the device side) and `shard_throughput.py`, so that each of them imports
it from here and none imports another for it."""

from __future__ import annotations

from omegaconf import OmegaConf

SIZE, BATCH = 224, 64


def recipe_cfg(auto_augment: str, **extra):
    """The data config of the classification recipe with `auto_augment` ("none", "rand", ...),
    augmented on the device, no erasing; `extra`: more data.* fields (e.g. decode_on="device")."""
    return OmegaConf.create(
        dict(
            train_crop_scale=[0.08, 1.0],
            hflip=0.5,
            crop_pct=0.875,
            interpolation="bilinear",
            auto_augment=auto_augment,
            augment_on="device",
            random_erasing=0.0,
            random_erasing_mode="pixel",
            **extra,
        )
    )
