"""The GPU path on one CUDA device, in one process (`pytest -m gpu`; skipped where there is none, as in CI). The
training runs: tests/multirank/test_gpu.py. `benchmarks/gpu/run.sh` runs both and the GPU benchmark rows."""

from __future__ import annotations


import pytest
import torch

from helpers import REPO, TINY_DATA, bf16_box_distances


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


CONFIGS = REPO / "configs"


def test_attention_runs_a_fused_kernel_never_math():
    from torch.profiler import ProfilerActivity, profile

    from visiondist.models import select_attention
    from visiondist.models.vit import VisionTransformer

    select_attention("auto")
    model = VisionTransformer(img_size=224, patch_size=16, num_classes=10, embed_dim=768, depth=2,
                              num_heads=12).cuda()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).float().sum().backward()
    ops = {e.key for e in prof.key_averages()}
    fused = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention",
             "aten::_scaled_dot_product_efficient_attention"}
    assert ops & fused and "aten::_scaled_dot_product_attention_math" not in ops, sorted(o for o in ops if "dot" in o)


def test_pipeline_timeline_reads_cuda_events_after_the_step():
    """On CUDA the timeline puts events around each action and reads them once the step is over: no action waits for
    the device (any synchronisation inside raises), and the intervals come back in order and positive."""
    from visiondist.parallel.timeline import Recorder

    recorder = Recorder(0, torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    with recorder.record():
        torch.cuda.set_sync_debug_mode("error")
        try:
            for microbatch in range(3):
                with recorder.action(0, "F", microbatch):
                    a @ a
        finally:
            torch.cuda.set_sync_debug_mode(0)
    events = recorder.events
    assert [e.microbatch for e in events] == [0, 1, 2]
    assert all(e.end > e.start >= 0 for e in events)
    assert all(later.start >= earlier.end - 1e-6 for earlier, later in zip(events, events[1:]))


def test_detector_anchors_and_boxes_under_bf16_stay_within_a_pixel():
    """The CPU test (tests/unit/test_detection_models.py) on the GPU with ResNet-50: with the box regressions zeroed every
    returned box is an anchor, so its distance to the fp32 anchors is the box arithmetic's alone."""
    from visiondist.cli import load_config
    from visiondist.models import build_model

    cfg = load_config(CONFIGS, ["model=fasterrcnn_r50", "data=shapes_coco", "data.min_size=800", "data.max_size=1333"],
                      inputs=None)
    boxes, distance = bf16_box_distances(build_model(cfg.model), "cuda")
    assert boxes.dtype == torch.float32 and len(boxes) > 20
    assert distance.max() <= 1.0, distance.max()


def test_loader_batches_are_pinned(tmp_path, tiny_shapes):
    from visiondist.cli import load_config
    from visiondist.data import build_classification_data

    cfg = load_config(CONFIGS, [*TINY_DATA, f"data.root={tiny_shapes}", "data.num_workers=2"], inputs=None)
    data = build_classification_data(cfg.data, 32, 0, 1, 1, 0, pin_memory=True)
    images, _ = next(iter(data.train_loader))
    assert images.is_pinned()


def test_device_augmentation_on_cuda_gives_the_cpus_pixels():
    """RandAugment rows applied to the same uint8 batch on CUDA and on the CPU (the ops are torchvision's arithmetic,
    batched): at most one grey level apart on at most 0.5% of the values; erasing noise identical (integer hash).
    Neither waits for the GPU (torch's sync debug mode warns at every host-device synchronisation)."""
    import random
    import warnings

    import numpy as np

    from visiondist.data.augment import AugmentPolicy
    from visiondist.data.augment_ops import apply_operations, erase

    policy = AugmentPolicy("rand", 96, random_erasing=1.0)
    rows = torch.from_numpy(np.stack([policy.draw(random.Random(i)) for i in range(64)]))
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (64, 3, 96, 96), dtype=torch.uint8, generator=g)
    cpu = apply_operations(images.clone(), rows, policy.layout)
    on_gpu = images.cuda()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            gpu = apply_operations(on_gpu, rows, policy.layout)
            erased_gpu = erase(torch.zeros(64, 3, 96, 96, device="cuda"), rows, policy.layout, "pixel")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)})
    assert not syncs, syncs
    gpu, erased_gpu = gpu.cpu(), erased_gpu.cpu()
    diff = (cpu.int() - gpu.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.005, (int(diff.max()), float((diff > 0).float().mean()))
    erased_cpu = erase(torch.zeros(64, 3, 96, 96), rows, policy.layout, "pixel")
    torch.testing.assert_close(erased_gpu, erased_cpu, rtol=0, atol=1e-5)


def test_nvjpeg_decoding_gives_the_cpu_decoders_batch(tmp_path):
    """data.decode_on=device on CUDA (nvJPEG, crop, resize, flip) against the same batch decoded on the CPU
    (libjpeg-turbo): the IDCTs differ by rounding: within 1.5 grey levels on average, 99.9% of values within 8."""
    import cv2
    import numpy as np
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader

    from visiondist.data.device_decode import collate_encoded, read_encoded
    from visiondist.data.imagefolder import ImageFolder
    from visiondist.data.transforms import ClassificationTransform

    rng = np.random.default_rng(0)
    for c in range(2):
        (tmp_path / str(c)).mkdir()
        for i in range(32):
            low = cv2.resize(rng.uniform(0, 255, (6, 8, 3)).astype(np.float32), (440, 390))
            image = np.clip(low + rng.normal(0, 10, low.shape), 0, 255).astype(np.uint8)
            cv2.imwrite(str(tmp_path / str(c) / f"{i}.jpg"), image, [cv2.IMWRITE_JPEG_QUALITY, 92])
    cfg = OmegaConf.create(dict(train_crop_scale=[0.08, 1.0], hflip=0.5, crop_pct=0.875, interpolation="bilinear",
                                auto_augment="none", decode_on="device"))
    data = ImageFolder(tmp_path, ClassificationTransform(cfg, True, 224, 0), train=True, reader=read_encoded)
    batch = next(iter(DataLoader(data, batch_size=64, collate_fn=collate_encoded(224, "bilinear"))))[0]
    on_cpu, on_gpu = batch.images(torch.device("cpu")), batch.images(torch.device("cuda")).cpu()
    diff = (on_cpu.float() - on_gpu.float()).abs()
    assert diff.mean() <= 1.5 and torch.quantile(diff.flatten()[::7], 0.999) <= 8, (float(diff.mean()),
                                                                                     float(diff.max()))
