"""The GPU path, on one CUDA device (`pytest -m gpu`; skipped where there is none, as in CI).
`benchmarks/gpu/run.sh` runs these and the GPU benchmark rows on a machine with torch preinstalled and no network."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import REPO, losses_of, run_cli, train_args, train_ok


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


def _steps_without_sync(cfg, layout, run_dir):
    """Rank entry: two warm-up steps, then three steps with every host-device synchronisation recorded (torch's
    sync debug mode warns at each, from the Python line that caused it): none may happen."""
    import warnings

    from visiondist.train.build import prepare_rank
    from visiondist.train.trainer import Trainer

    prepare_rank(cfg, layout, run_dir)
    trainer = Trainer(cfg, layout, run_dir)
    batches = iter(trainer.data.train_loader)
    for _ in range(2):
        trainer.train_step(batches)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                trainer.train_step(batches)
                trainer.step += 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)})
    assert not syncs, f"the training step synchronised with the GPU at: {syncs}"
    return True


def test_the_training_step_never_waits_for_the_gpu(tmp_path, tiny_shapes):
    from visiondist.cli import load_config
    from visiondist.launch import launch

    cfg = load_config(CONFIGS, _gpu_args(tiny_shapes, tmp_path / "run", "trainer.precision=bf16",
                                         "trainer.max_steps=20", "data.num_workers=0"))
    launch(_steps_without_sync, cfg)  # data.num_workers=0: the loader is not what is being checked here


def test_fsdp_at_world_size_one(tmp_path, tiny_shapes):
    run = tmp_path / "run"
    train_ok(*_gpu_args(tiny_shapes, run, "parallel=fsdp", "trainer.devices=1", "trainer.precision=bf16",
                        "trainer.max_steps=4"))
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_planner_memory_is_within_15_percent_of_the_gpu(tmp_path, tiny_shapes):
    """The planner's device bytes for ViT-S (all 12 blocks: the tiny set's arguments make it 2 deep), bf16, batch 64
    against torch's peak after a few steps."""
    from visiondist.parallel.memory import ViTShape, rank_memory

    run = tmp_path / "run"
    model = ["model=vit_small", "model.depth=12", "data.img_size=224"]
    train_ok(*_gpu_args(tiny_shapes, run, *model, "data.batch_size=64",
                        "trainer.precision=bf16", "trainer.max_steps=4", "trainer.eval_every=1000"))
    measured = json.loads((run / "summary.json").read_text())["peak GPU memory (GiB)"] * 2**30
    from visiondist.cli import load_config

    cfg = load_config(CONFIGS, model, inputs=None)
    planned = rank_memory(ViTShape.from_config(cfg.model), 1, 1, 1, 64, precision="bf16").device
    assert abs(planned - measured) / measured <= 0.15, (planned / 2**30, measured / 2**30)
