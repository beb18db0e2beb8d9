"""The GPU figures of `benchmarks/data_throughput.py` (run there when a CUDA device is present):
nvJPEG decode images/s, the device side of `data.decode_on=device`, and the device augmentation's
share of a ViT-B/16 step."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from input_recipe import BATCH, SIZE, recipe_cfg
from torch.utils.data import DataLoader

from visiondist.data.device_decode import collate_encoded, read_encoded
from visiondist.data.imagefolder import ImageFolder
from visiondist.data.transforms import ClassificationTransform


def _cuda_rate(fn, images: int, n: int = 3) -> float:
    """Images per second of `fn` on the CUDA device (2 warm-up calls, then n timed,
    synchronised)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return n * images / (time.perf_counter() - t)


def gpu_figures(root: Path) -> dict:
    """On the CUDA device: nvJPEG decode images/s (batches of 64), the whole device side of
    `data.decode_on=device` (decode, crop, resize, flip of the batches the workers hand over), and
    the device augmentation's share of a ViT-B/16 bf16 step at batch 256."""
    from visiondist.data.device_decode import decode_jpegs

    cuda = torch.device("cuda")
    paths = [p for p, _ in ImageFolder(root / "train").samples][:256]
    data = [torch.frombuffer(bytearray(Path(p).read_bytes()), dtype=torch.uint8) for p in paths]
    split = ImageFolder(
        root / "train",
        ClassificationTransform(recipe_cfg("none", decode_on="device"), True, SIZE, 0),
        reader=read_encoded,
    )
    keys = [(i, 0) for i in range(len(split))]
    batches = list(
        DataLoader(
            split,
            batch_sampler=[keys[i : i + BATCH] for i in range(0, len(keys) - BATCH + 1, BATCH)],
            collate_fn=collate_encoded(SIZE, "bilinear"),
        )
    )
    nvjpeg = _cuda_rate(
        lambda: [decode_jpegs(data[i : i + BATCH], cuda) for i in range(0, len(data), BATCH)],
        len(data),
    )
    device_side = _cuda_rate(lambda: [b[0].images(cuda) for b in batches], BATCH * len(batches))
    step_s, augment_s, both_s = _step_and_augment_seconds()
    return {
        "device": torch.cuda.get_device_name(),
        "nvjpeg_images_per_s": round(nvjpeg),
        "decode_crop_resize_images_per_s": round(device_side),
        "vit_b16_step_ms_b256": round(step_s * 1e3, 2),
        "device_augment_ms_b256": round(augment_s * 1e3, 2),
        "vit_b16_step_with_augment_ms_b256": round(both_s * 1e3, 2),
        "device_augment_share": round(max(both_s - step_s, 0.0) / both_s, 4),
    }


def _step_and_augment_seconds(batch: int = 256) -> tuple[float, float, float]:
    """Seconds of one ViT-B/16 bf16 training step, of the DeiT recipe's device augmentation
    (RandAugment 2/9, erasing 0.25) of the same batch alone, and of the two in sequence (what a
    training step with the augmentation costs: the launches of one overlap the other's kernels), on
    the CUDA device."""
    import random

    from visiondist.data.augment import AugmentPolicy
    from visiondist.data.augment_ops import apply_operations, erase
    from visiondist.models.vit import VisionTransformer

    model = VisionTransformer(
        img_size=SIZE, patch_size=16, num_classes=1000, embed_dim=768, depth=12, num_heads=12
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(batch, 3, SIZE, SIZE, device="cuda")
    y = torch.randint(0, 1000, (batch,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    policy = AugmentPolicy("rand", SIZE, random_erasing=0.25)
    rows = torch.from_numpy(np.stack([policy.draw(random.Random(i)) for i in range(batch)]))
    images = torch.randint(0, 256, (batch, 3, SIZE, SIZE), dtype=torch.uint8, device="cuda")

    def augment():
        out = apply_operations(images.clone(), rows, policy.layout).float()
        erase(out, rows, policy.layout, "pixel")

    def both():
        augment()
        step()

    return (
        1.0 / _cuda_rate(step, 1, 10),
        1.0 / _cuda_rate(augment, 1, 10),
        1.0 / _cuda_rate(both, 1, 10),
    )
