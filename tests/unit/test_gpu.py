"""The GPU path on one CUDA device, in one process (`pytest -m gpu`; skipped where there is none, as
in CI). The training runs: tests/multirank/test_gpu.py. `benchmarks/gpu/run.sh` runs both and the
GPU benchmark rows."""

from __future__ import annotations

import pytest
import torch
from helpers import REPO, TINY_DATA, bf16_box_distances

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


CONFIGS = REPO / "configs"


def test_attention_runs_a_fused_kernel_never_math():
    from torch.profiler import ProfilerActivity, profile

    from visiondist.models import select_attention
    from visiondist.models.vit import VisionTransformer

    select_attention("auto")
    model = VisionTransformer(
        img_size=224, patch_size=16, num_classes=10, embed_dim=768, depth=2, num_heads=12
    ).cuda()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    with (
        torch.autocast("cuda", dtype=torch.bfloat16),
        profile(activities=[ProfilerActivity.CPU]) as prof,
    ):
        model(x).float().sum().backward()
    ops = {e.key for e in prof.key_averages()}
    fused = {
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_efficient_attention",
    }
    assert ops & fused and "aten::_scaled_dot_product_attention_math" not in ops, sorted(
        o for o in ops if "dot" in o
    )


def test_auto_attention_runs_the_kernel_it_timed_fastest():
    """model.sdpa=auto on CUDA: the kernels timed at ViT-B/16's shape in bf16, torch given them
    fastest first, and the fastest is the one a ViT-B block's forward and backward then run (eager
    and compiled)."""
    from torch.profiler import ProfilerActivity, profile

    from visiondist.models.sdpa import fastest_first, select_attention, time_kernels
    from visiondist.models.vit import VisionTransformer

    op = {
        "flash": "aten::_scaled_dot_product_flash_attention",
        "cudnn": "aten::_scaled_dot_product_cudnn_attention",
        "efficient": "aten::_scaled_dot_product_efficient_attention",
    }
    times = time_kernels((32, 12, 197, 64), torch.bfloat16, torch.device("cuda"))
    order = fastest_first(times)
    print(
        "attention kernels at 32x12x197x64 bf16:",
        {n: t and round(t * 1e3, 3) for n, t in times.items()},
    )
    assert order, times
    try:
        select_attention("auto", order)
        model = VisionTransformer(
            img_size=224, patch_size=16, num_classes=10, embed_dim=768, depth=2, num_heads=12
        ).cuda()
        x = torch.randn(32, 3, 224, 224, device="cuda")
        for run in (model, torch.compile(model)):
            with (
                torch.autocast("cuda", dtype=torch.bfloat16),
                profile(activities=[ProfilerActivity.CPU]) as prof,
            ):
                run(x).float().sum().backward()
            ops = {e.key for e in prof.key_averages()}
            assert op[order[0]] in ops and not ({op[n] for n in order[1:]} & ops), sorted(
                o for o in ops if "dot" in o
            )
    finally:
        select_attention("auto")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_blocks_compile_and_follow_bf16(recipe):
    """trainer.fp8 on a GPU with float8 tensor cores: two ViT-B/16 blocks' linear layers as
    torchao's Float8Linear, compiled, give gradients aligned with bf16's (cosine > 0.98 per
    converted weight)."""
    import copy

    import torch.nn.functional as F

    from visiondist.engine.fp8 import MIN_CAPABILITY, to_float8
    from visiondist.models.vit import VisionTransformer
    from visiondist.parallel import transformer_blocks

    if torch.cuda.get_device_capability() < MIN_CAPABILITY:
        pytest.skip("no float8 tensor cores")
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    ref = VisionTransformer(
        img_size=224, patch_size=16, num_classes=10, embed_dim=768, depth=2, num_heads=12
    ).cuda()
    fp8 = copy.deepcopy(ref)
    # torchao's filter would keep ViT-B's bf16
    assert to_float8(transformer_blocks(fp8), recipe, "all") == (12, 12)
    x, y = torch.randn(32, 3, 224, 224, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    grads = []
    for model in (ref, torch.compile(fp8)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            F.cross_entropy(model(x).float(), y).backward()
        grads.append(
            {
                n: p.grad.float().flatten()
                for n, p in (ref if model is ref else fp8).named_parameters()
                if n.endswith("weight") and ".blocks." in f".{n}"
            }
        )
    for name, g in grads[0].items():
        if g.numel() > 768:  # the linear layers' weights (not the norms')
            assert F.cosine_similarity(g, grads[1][name], dim=0) > 0.98, name


def test_pipeline_timeline_reads_cuda_events_after_the_step():
    """On CUDA the timeline puts events around each action and reads them once the step is over: no
    action waits for the device (any synchronisation inside raises), and the intervals come back in
    order and positive."""
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
    """The CPU test (tests/unit/test_detection_models.py) on the GPU with ResNet-50: with the box
    regressions zeroed every returned box is an anchor, so its distance to the fp32 anchors is the
    box arithmetic's alone."""
    from visiondist.cli import load_config
    from visiondist.models import build_model

    cfg = load_config(
        CONFIGS,
        ["model=fasterrcnn_r50", "data=shapes_coco", "data.min_size=800", "data.max_size=1333"],
        inputs=None,
    )
    boxes, distance = bf16_box_distances(build_model(cfg.model), "cuda")
    assert boxes.dtype == torch.float32 and len(boxes) > 20
    assert distance.max() <= 1.0, distance.max()


def test_loader_batches_are_pinned(tmp_path, tiny_shapes):
    from visiondist.cli import load_config
    from visiondist.data import build_classification_data

    cfg = load_config(
        CONFIGS, [*TINY_DATA, f"data.root={tiny_shapes}", "data.num_workers=2"], inputs=None
    )
    data = build_classification_data(cfg.data, 32, 0, 1, 1, 0, pin_memory=True)
    images, _ = next(iter(data.train_loader))
    assert images.is_pinned()


def test_device_augmentation_on_cuda_gives_the_cpus_pixels():
    """RandAugment rows applied to the same uint8 batch on CUDA and on the CPU (the ops are
    torchvision's arithmetic, batched): at most one grey level apart on at most 0.5% of the values;
    erasing noise identical (integer hash). Neither waits for the GPU (torch's sync debug mode warns
    at every host-device synchronisation)."""
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
            erased_gpu = erase(
                torch.zeros(64, 3, 96, 96, device="cuda"), rows, policy.layout, "pixel"
            )
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sorted(
        {
            f"{w.filename}:{w.lineno}"
            for w in caught
            if "called a synchronizing CUDA operation" in str(w.message)
        }
    )
    assert not syncs, syncs
    gpu, erased_gpu = gpu.cpu(), erased_gpu.cpu()
    diff = (cpu.int() - gpu.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.005, (
        int(diff.max()),
        float((diff > 0).float().mean()),
    )
    erased_cpu = erase(torch.zeros(64, 3, 96, 96), rows, policy.layout, "pixel")
    torch.testing.assert_close(erased_gpu, erased_cpu, rtol=0, atol=1e-5)


def test_nvjpeg_decoding_gives_the_cpu_decoders_batch(tmp_path):
    """data.decode_on=device on CUDA (nvJPEG, crop, resize, flip) against the same batch decoded on
    the CPU (libjpeg-turbo): the IDCTs differ by rounding: within 1.5 grey levels on average, 99.9%
    of values within 8."""
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
    cfg = OmegaConf.create(
        dict(
            train_crop_scale=[0.08, 1.0],
            hflip=0.5,
            crop_pct=0.875,
            interpolation="bilinear",
            auto_augment="none",
            decode_on="device",
        )
    )
    data = ImageFolder(
        tmp_path, ClassificationTransform(cfg, True, 224, 0), train=True, reader=read_encoded
    )
    batch = next(
        iter(DataLoader(data, batch_size=64, collate_fn=collate_encoded(224, "bilinear")))
    )[0]
    on_cpu, on_gpu = batch.images(torch.device("cpu")), batch.images(torch.device("cuda")).cpu()
    diff = (on_cpu.float() - on_gpu.float()).abs()
    assert diff.mean() <= 1.5 and torch.quantile(diff.flatten()[::7], 0.999) <= 8, (
        float(diff.mean()),
        float(diff.max()),
    )


def _photo_batch(count: int, size: int = 224):
    """An `EncodedBatch` of `count` JPEGs cut from scikit-image's photographs (300-500 px a side,
    quality 90), each cropped whole, as data.decode_on=device's workers hand them over."""
    import cv2
    import numpy as np
    from skimage import data

    from visiondist.data.device_decode import CROP_FIELDS, collate_encoded

    sources = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    rng, samples = np.random.default_rng(0), []
    for i in range(count):
        source = sources[i % len(sources)]
        h, w = (
            int(rng.integers(300, min(500, source.shape[0]) + 1)),
            int(rng.integers(300, min(500, source.shape[1]) + 1)),
        )
        crop = np.ascontiguousarray(source[:h, :w])
        encoded = cv2.imencode(
            ".jpg", cv2.cvtColor(crop, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 90]
        )[1]
        row = torch.zeros(CROP_FIELDS, dtype=torch.float64)
        row[:6] = torch.tensor([1, 0, 0, h, w, i % 2], dtype=torch.float64)
        samples.append((torch.from_numpy(encoded.reshape(-1).copy()), 0, row))
    return collate_encoded(size, "bilinear")(samples)[0]


def test_decoding_ahead_never_writes_memory_that_queued_kernels_read():
    """After pytorch/vision#9606. Each of 200 iterations fills tensors of the decoder's output sizes
    with known values, queues a long kernel and then a reduction of each (and of the images handed
    over the iteration before), frees them all while the reductions wait, and only then lets the
    next batch (32 real photos) be decoded. No reduction may see a changed value. The same
    iterations decoding on the step's stream (the path data.decode_on=device had before
    `DecodeAhead`) are counted and printed: where nvJPEG runs on its hardware engine, they
    corrupt."""
    import threading

    from visiondist.data.decode_ahead import DecodeAhead

    device = torch.device("cuda")
    batch = _photo_batch(32)
    reference = batch.decode(device)
    torch.cuda.synchronize()
    shapes = [(3, int(h), int(w)) for h, w in batch.crops[:, 3:5].tolist()]
    value = [k % 250 + 1 for k in range(len(shapes))]
    expected = [v * 3 * h * w for v, (_, h, w) in zip(value, shapes)] + [
        int(reference.sum(dtype=torch.int64))
    ]

    def corrupted(decode_next, iterations: int = 200) -> int:
        bad, images = 0, decode_next()
        for _ in range(iterations):
            filled = [
                torch.full(shape, v, dtype=torch.uint8, device=device)
                for shape, v in zip(shapes, value)
            ]
            torch.cuda.synchronize()
            torch.cuda._sleep(40_000_000)  # ~20 ms: the reductions below wait behind it
            sums = torch.stack([t.sum(dtype=torch.int64) for t in (*filled, images)])
            # their blocks go back to the caching allocator while the reductions wait
            del filled, images
            images = decode_next()  # noqa: F841 (the next iteration sums it)
            torch.cuda.synchronize()
            bad += sums.tolist() != expected
        return bad

    gate, finished = threading.Semaphore(0), threading.Event()

    # the decoding thread gets a batch only once the iteration has freed its tensors
    def released_batches():
        while True:
            gate.acquire()
            if finished.is_set():
                return
            yield batch, torch.zeros(len(batch), dtype=torch.int64)

    ahead = DecodeAhead(released_batches(), device)

    def decoded_ahead():
        gate.release()
        return next(ahead)[0].images(device)

    ours = corrupted(decoded_ahead)
    finished.set()
    gate.release()
    ahead.close()
    on_the_step_stream = corrupted(lambda: batch.decode(device))
    print(
        f"corrupted iterations of 200: decoded ahead {ours}, decoded on the step's stream "
        f"{on_the_step_stream}"
    )
    assert ours == 0, f"{ours} of 200 iterations read memory the decoder wrote"
