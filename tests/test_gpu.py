"""The GPU path, on one CUDA device (`pytest -m gpu`; skipped where there is none, as in CI).
`benchmarks/gpu/run.sh` runs these and the GPU benchmark rows on a machine with torch preinstalled and no network."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import REPO, TINY_DATA, losses_of, run_cli, train_args, train_ok

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIGS = REPO / "configs"
ON_GPU = ["trainer.accelerator=cuda", "data.num_workers=2"]  # the shipped loader settings


def _gpu_args(data: Path, run: Path, *extra: str) -> list[str]:
    return [a for a in train_args(data, run, *ON_GPU, *extra) if a not in ("trainer.accelerator=cpu",
                                                                              "data.num_workers=0")]


def test_bf16_training_on_the_gpu(tmp_path, tiny_shapes):
    run = tmp_path / "run"
    train_ok(*_gpu_args(tiny_shapes, run, "trainer.precision=bf16", "trainer.max_steps=6"))
    summary = json.loads((run / "summary.json").read_text())
    assert math.isfinite(summary["final train loss"]) and summary["peak GPU memory (GiB)"] > 0


def test_resume_on_the_gpu_continues_the_run(tmp_path, tiny_shapes):
    common = ["model.num_heads=2", "trainer.max_steps=8", "trainer.checkpoint_every=2", "trainer.tf32=false"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_ok(*_gpu_args(tiny_shapes, straight, *common))
    train_ok(*_gpu_args(tiny_shapes, split, *common, "trainer.stop_at_step=4"))
    train_ok(f"trainer.run_dir={split}")
    a, b = losses_of(straight), losses_of(split)
    assert [b[s] for s in range(5, 9)] == pytest.approx([a[s] for s in range(5, 9)], rel=1e-4)


def test_a_cuda_checkpoint_exports_to_timm_on_the_cpu(tmp_path, tiny_shapes):
    import timm
    from safetensors.torch import load_file

    run, out = tmp_path / "run", tmp_path / "vit.safetensors"
    train_ok(*_gpu_args(tiny_shapes, run, "trainer.max_steps=2"))
    result = run_cli([f"run_dir={run}", f"out={out}"], script=REPO / "tools" / "export.py")
    assert result.returncode == 0, result.stdout[-3000:]
    info = json.loads(out.with_suffix(".json").read_text())
    model = timm.create_model(**info["create"], pretrained=False)
    model.load_state_dict(load_file(out), strict=True)


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


def _steps_without_sync(cfg, layout, run_dir):
    """Rank entry: two warm-up steps, then three steps with any host-device synchronisation raising."""
    from visiondist.engine.build import prepare_rank
    from visiondist.engine.trainer import Trainer

    prepare_rank(cfg, layout, run_dir)
    trainer = Trainer(cfg, layout, run_dir)
    batches = iter(trainer.data.train_loader)
    for _ in range(2):
        trainer.train_step(batches)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            trainer.train_step(batches)
            trainer.step += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return True


def test_the_training_step_never_waits_for_the_gpu(tmp_path, tiny_shapes):
    from visiondist.cli import load_config
    from visiondist.launch import launch

    cfg = load_config(CONFIGS, _gpu_args(tiny_shapes, tmp_path / "run", "trainer.precision=bf16",
                                         "trainer.max_steps=20", "data.num_workers=0"))
    launch(_steps_without_sync, cfg)  # data.num_workers=0: the loader is not what is being checked here


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


def test_fsdp_at_world_size_one(tmp_path, tiny_shapes):
    run = tmp_path / "run"
    train_ok(*_gpu_args(tiny_shapes, run, "parallel=fsdp", "trainer.devices=1", "trainer.precision=bf16",
                        "trainer.max_steps=4"))
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_detector_anchors_and_boxes_under_bf16_stay_within_a_pixel():
    """The CPU test (tests/test_detection_models.py) on the GPU with ResNet-50: with the box regressions zeroed every
    returned box is an anchor, so its distance to the fp32 anchors is the box arithmetic's alone."""
    from torchvision.ops import boxes as box_ops

    from visiondist.cli import load_config
    from visiondist.models import build_model

    cfg = load_config(CONFIGS, ["model=fasterrcnn_r50", "data=shapes_coco", "data.min_size=800", "data.max_size=1333"],
                      inputs=None)
    model = build_model(cfg.model).cuda().eval()
    for layer in (model.rpn.head.bbox_pred, model.roi_heads.box_predictor.bbox_pred):
        torch.nn.init.zeros_(layer.weight)
        torch.nn.init.zeros_(layer.bias)
    image = torch.rand(3, 800, 1333, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        boxes = model([image])[0]["boxes"]
    with torch.no_grad():
        images, _ = model.transform([image])
        features = list(model.backbone(images.tensors).values())
        anchors = box_ops.clip_boxes_to_image(model.rpn.anchor_generator(images, features)[0], (800, 1333))
    assert boxes.dtype == torch.float32 and len(boxes) > 20
    assert (boxes[:, None, :] - anchors[None]).abs().amax(dim=-1).amin(dim=-1).max() <= 1.0


def test_planner_memory_is_within_15_percent_of_the_gpu(tmp_path, tiny_shapes):
    """The planner's device bytes for ViT-S, bf16, batch 64 against torch's peak after a few steps."""
    from visiondist.parallel.memory import ViTShape, rank_memory

    run = tmp_path / "run"
    train_ok(*_gpu_args(tiny_shapes, run, "model=vit_small", "data.img_size=224", "data.batch_size=64",
                        "trainer.precision=bf16", "trainer.max_steps=4", "trainer.eval_every=1000"))
    measured = json.loads((run / "summary.json").read_text())["peak GPU memory (GiB)"] * 2**30
    from visiondist.cli import load_config

    cfg = load_config(CONFIGS, ["model=vit_small", "data.img_size=224"], inputs=None)
    planned = rank_memory(ViTShape.from_config(cfg.model), 1, 1, 1, 64, precision="bf16").device
    assert abs(planned - measured) / measured <= 0.15, (planned / 2**30, measured / 2**30)


def test_loader_batches_are_pinned(tmp_path, tiny_shapes):
    from visiondist.cli import load_config
    from visiondist.data import build_classification_data

    cfg = load_config(CONFIGS, [*TINY_DATA, f"data.root={tiny_shapes}", "data.num_workers=2"], inputs=None)
    data = build_classification_data(cfg.data, 32, 0, 1, 1, 0, pin_memory=True)
    images, _ = next(iter(data.train_loader))
    assert images.is_pinned()
