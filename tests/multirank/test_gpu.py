"""The GPU path, on one CUDA device (`pytest -m gpu`; skipped where there is none, as in CI).
`benchmarks/gpu/run.sh` runs these and the GPU benchmark rows on a machine with torch preinstalled
and no network."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, losses_of, run_cli, train_args, train_ok

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


CONFIGS = REPO / "configs"


ON_GPU = ["trainer.accelerator=cuda", "data.num_workers=2"]  # the shipped loader settings
# 40 steps of 256 in one epoch: no epoch's start inside a timed window
PHOTO_TRAIN, PHOTO_VAL = 10240, 256


@pytest.fixture(scope="module")
def photos() -> Path:
    """Real photographs (benchmarks/photos.py) in an ImageFolder tree: 5 classes, ~440 x 390 px
    JPEGs, written once per machine under $VISIONDIST_DATA (benchmarks/gpu/run.sh writes them
    first)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from photos import ensure_photo_set

    root = Path(os.environ.get("VISIONDIST_DATA", "/tmp/visiondist-data")) / f"photos-{PHOTO_TRAIN}"
    return ensure_photo_set(root, PHOTO_TRAIN, PHOTO_VAL, processes=min(16, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def few_photos() -> Path:
    """2,048 of the same photographs (the set `run.sh mfu` writes): for checks that need real
    shapes, not an epoch."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from photos import ensure_photo_set

    root = Path(os.environ.get("VISIONDIST_DATA", "/tmp/visiondist-data")) / "photos-2048"
    return ensure_photo_set(root, 2048, 64, processes=min(16, os.cpu_count() or 1))


# the DeiT recipe as vit_b16_imagenet sets it, at batch 256 on one GPU, every loader setting the
# shipped default
DEIT = [
    "experiment=vit_b16_imagenet",
    "data.batch_size=256",
    "data.eval_batch_size=256",
    "trainer.max_steps=30",
    "schedule.warmup_steps=10",
    "trainer.eval_every=1000",
    "trainer.accelerator=cuda",
    "trainer.loggers=[csv]",
]


def test_decode_on_device_trains_the_deit_recipe_as_the_loader_path_does(tmp_path, photos):
    """30 steps of the DeiT recipe at batch 256 under the default logging (a loss read every 10
    steps: the host runs ahead of the device in between), where decoding on the step's stream made
    the gradients non-finite at step 2: every step finite (a non-finite one stops the run), and the
    logged losses within one run-to-run spread (two seeds of the loader path) of the loader
    path's."""
    runs = {}
    for name, extra in (
        ("device", ["data.decode_on=device"]),
        ("loader", []),
        ("loader_seed1", ["trainer.seed=1"]),
    ):
        out = train_ok(
            *DEIT, f"data.root={photos}", f"trainer.run_dir={tmp_path / name}", *extra, timeout=240
        )
        runs[name] = losses_of(tmp_path / name)
        assert sorted(runs[name]) == [10, 20, 30], out[-3000:]
        assert all(math.isfinite(v) for v in runs[name].values())
    summary = json.loads((tmp_path / "device" / "summary.json").read_text())
    assert summary["decode_on=device (rank 0)"].startswith("7680 of 7680 images by"), summary
    # the same weights evaluated through OpenCV's decoder instead of the training decoder (nvJPEG):
    # printed
    out = train_ok(
        f"run_dir={tmp_path / 'device'}", "data.decode_on=loader", script=REPO / "tools" / "eval.py"
    )
    print(
        f"device-decoded run: val top-1 {summary['val top-1 (%)']} decoded by nvJPEG, "
        f"{out.strip().splitlines()[-3:]} decoded by OpenCV"
    )
    for step in (10, 20, 30):
        loader = (runs["loader"][step], runs["loader_seed1"][step])
        spread = max(abs(loader[0] - loader[1]), 0.02)
        assert min(loader) - spread <= runs["device"][step] <= max(loader) + spread, (step, runs)


def _gpu_args(data: Path, run: Path, *extra: str) -> list[str]:
    return [
        a
        for a in train_args(data, run, *ON_GPU, *extra)
        if a not in ("trainer.accelerator=cpu", "data.num_workers=0")
    ]


def test_bf16_training_on_the_gpu(tmp_path, tiny_shapes):
    run = tmp_path / "run"
    train_ok(*_gpu_args(tiny_shapes, run, "trainer.precision=bf16", "trainer.max_steps=6"))
    summary = json.loads((run / "summary.json").read_text())
    assert math.isfinite(summary["final train loss"]) and summary["peak GPU memory (GiB)"] > 0


def test_resume_on_the_gpu_continues_the_run(tmp_path, tiny_shapes):
    common = [
        "model.num_heads=2",
        "trainer.max_steps=8",
        "trainer.checkpoint_every=2",
        "trainer.tf32=false",
    ]
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


# what torch's sync debug mode says at a synchronising call (its first use also warns that the mode
# is a prototype "that does not yet detect all synchronizing operations": not a synchronisation)
SYNC_WARNING = "called a synchronizing CUDA operation"


def _steps_without_sync(cfg, layout, run_dir):
    """Rank entry: two warm-up steps, then three steps with every host-device synchronisation
    recorded (torch's sync debug mode warns at each, from the Python line that caused it): none may
    happen in the step's thread. Under data.decode_on=device the decoding thread's are listed apart:
    it may wait for its own stream."""
    import threading
    import warnings

    from visiondist.engine.build import prepare_rank
    from visiondist.engine.run import build_trainer

    prepare_rank(cfg, layout, run_dir)
    trainer = build_trainer(cfg, layout, run_dir)
    step = trainer.optimizer_step
    # as the loop takes them (decode_on=device: ahead)
    batches = trainer.parts.task.train_batches(layout.device)
    for _ in range(2):
        step.train_step(batches)
    torch.cuda.synchronize()
    caught = []

    def record(message, category, filename, lineno, file=None, line=None):
        caught.append(
            (
                threading.current_thread() is threading.main_thread(),
                str(message),
                f"{filename}:{lineno}",
            )
        )

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(3):
                step.train_step(batches)
                trainer.state.step += 1
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if hasattr(batches, "close"):
        batches.close()
    syncs = sorted({where for main, text, where in caught if main and SYNC_WARNING in text})
    others = sorted({where for main, text, where in caught if not main and SYNC_WARNING in text})
    print(f"the decoding thread synchronised at: {others}")
    assert not syncs, f"the training step synchronised with the GPU at: {syncs}"
    return True


# the DeiT recipe's device work (vit_b16_imagenet's settings): RandAugment and erasing on the
# device, mixup / cutmix, soft targets with label smoothing, the EMA
RECIPE = [
    "data.auto_augment=rand",
    "data.random_erasing=0.25",
    "data.mixup=0.8",
    "data.cutmix=1.0",
    "trainer.label_smoothing=0.1",
    "trainer.ema_decay=0.99996",
]


# data.resolution=native on images from 3:1 to 1:3 (their own set: tiny_shapes is square), one image
# a sequence and packed (the CPU test of the same steps: tests/unit/test_native.py)
NATIVE = [
    "data.synthetic.max_aspect=3",
    "model.patch_size=8",
    "model.num_heads=2",
    "data.resolution=native",
]


@pytest.mark.parametrize(
    "extra",
    [
        ["data.decode_on=loader"],
        ["data.decode_on=device"],
        ["data.decode_on=device", *RECIPE],
        NATIVE,
        [*NATIVE, "data.native.pack=true", "data.batch_size=4"],
    ],
    ids=["loader", "device", "device+deit", "native", "native+packed"],
)
def test_the_training_step_never_waits_for_the_gpu(tmp_path, tiny_shapes, extra):
    from visiondist.cli import load_config
    from visiondist.launch import launch

    data = tmp_path / "native" if "data.resolution=native" in extra else tiny_shapes
    cfg = load_config(
        CONFIGS,
        _gpu_args(
            data,
            tmp_path / "run",
            "trainer.precision=bf16",
            "trainer.max_steps=20",
            "data.num_workers=0",
            *extra,
        ),
    )
    # data.num_workers=0: the loader is not what is being checked here
    launch(_steps_without_sync, cfg)


def test_native_batches_copied_ahead_train_as_copies_that_wait(tmp_path, few_photos):
    """ViT-S/16 on real photographs at their own aspect ratios (one image a sequence), 30 steps at
    batch 256's tokens in bf16, the shipped loader (2 workers, pinned batches, each copied to the
    GPU without waiting: the host queues steps ahead of the device): every step finite, and the
    logged losses within one run-to-run spread (two seeds) of the same run with every launch and
    copy waited for (CUDA_LAUNCH_BLOCKING=1), where a pinned batch reused before its copy ended
    would train on other pixels or labels."""
    from helpers import finish_job, job_env, start_job

    args = [
        "data=imagenet",
        "model=vit_small",
        "data.img_size=224",
        "data.batch_size=256",
        "data.resolution=native",
        "trainer.precision=bf16",
        "trainer.max_steps=30",
        "trainer.eval_every=1000",
        "trainer.accelerator=cuda",
        "trainer.loggers=[csv]",
        f"data.root={few_photos}",
    ]
    runs = {}
    for name, extra, env in (
        ("ahead", [], {}),
        ("waited", [], {"CUDA_LAUNCH_BLOCKING": "1"}),
        ("waited_seed1", ["trainer.seed=1"], {"CUDA_LAUNCH_BLOCKING": "1"}),
    ):
        proc = start_job(
            [
                sys.executable,
                str(REPO / "tools" / "train.py"),
                *args,
                f"trainer.run_dir={tmp_path / name}",
                *extra,
            ],
            env=job_env(**env),
        )
        out = finish_job(proc, 300, name)
        assert proc.returncode == 0, out[-3000:]
        runs[name] = losses_of(tmp_path / name)
        assert sorted(runs[name]) == [10, 20, 30] and all(
            math.isfinite(v) for v in runs[name].values()
        ), out[-3000:]
    print(runs)
    for step in (10, 20, 30):
        waited = (runs["waited"][step], runs["waited_seed1"][step])
        spread = max(abs(waited[0] - waited[1]), 0.02)
        assert abs(runs["ahead"][step] - waited[0]) <= spread, (step, runs)


def test_fsdp_at_world_size_one(tmp_path, tiny_shapes):
    run = tmp_path / "run"
    train_ok(
        *_gpu_args(
            tiny_shapes,
            run,
            "parallel=fsdp",
            "trainer.devices=1",
            "trainer.precision=bf16",
            "trainer.max_steps=4",
        )
    )
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def test_planner_memory_is_within_15_percent_of_the_gpu(tmp_path, tiny_shapes):
    """The planner's device bytes for ViT-S (all 12 blocks: the tiny set's arguments make it 2
    deep), bf16, batch 64 against torch's peak after a few steps."""
    from visiondist.models.shape import ViTShape
    from visiondist.plan.memory import rank_memory

    run = tmp_path / "run"
    model = ["model=vit_small", "model.depth=12", "data.img_size=224"]
    train_ok(
        *_gpu_args(
            tiny_shapes,
            run,
            *model,
            "data.batch_size=64",
            "trainer.precision=bf16",
            "trainer.max_steps=4",
            "trainer.eval_every=1000",
        )
    )
    measured = json.loads((run / "summary.json").read_text())["peak GPU memory (GiB)"] * 2**30
    from visiondist.cli import load_config

    cfg = load_config(CONFIGS, model, inputs=None)
    planned = rank_memory(ViTShape.from_config(cfg.model), 1, 1, 1, 64, precision="bf16").device
    assert abs(planned - measured) / measured <= 0.15, (planned / 2**30, measured / 2**30)


def test_log_lines_summary_and_benchmark_agree_on_the_step_rate(tmp_path, photos):
    """ViT-B/16, bf16, batch 256 on real photos (the loader keeps up: the rate is the step's): the
    log lines' img/s of the windows after the first, the summary's steady-state figure and
    tools/benchmark.py's within 5% of each other; MFU printed beside img/s."""
    from visiondist.observe.metrics import read_metrics

    common = [
        "model=vit_base",
        "data=imagenet",
        f"data.root={photos}",
        "data.batch_size=256",
        "data.img_size=224",
        "trainer.precision=bf16",
        "trainer.accelerator=cuda",
        "trainer.loggers=[csv]",
    ]
    run = tmp_path / "run"
    out = train_ok(
        *common,
        "trainer.max_steps=40",
        "trainer.eval_every=1000",
        "data.eval_batch_size=256",
        f"trainer.run_dir={run}",
        timeout=300,
    )
    assert "MFU" in out, out[-3000:]
    logged = {
        int(r["step"]): r["images_per_s"]
        for r in read_metrics(run / "metrics.csv")
        if r["images_per_s"]
    }
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steady state"].startswith("steps 11-40"), summary
    steady = summary["throughput, steady state (img/s)"]
    results = tmp_path / "bench"
    bench = run_cli(
        [
            *common,
            "bench.baseline=false",
            "bench.peak=false",
            "bench.loader_batches=0",
            "bench.steps=10",
            f"bench.results_dir={results}",
            f"trainer.output_dir={tmp_path / 'runs'}",
        ],
        timeout=300,
        script=REPO / "tools" / "benchmark.py",
    )
    assert bench.returncode == 0, bench.stdout[-4000:]
    benchmark = json.loads((results / "results.jsonl").read_text().splitlines()[0])["images_per_s"]
    print(f"img/s: log lines {logged}, summary steady state {steady}, benchmark {benchmark:.0f}")
    for step in (20, 30, 40):
        assert logged[step] == pytest.approx(benchmark, rel=0.05), (logged, steady, benchmark)
    assert steady == pytest.approx(benchmark, rel=0.05), (logged, steady, benchmark)


def test_cuda_graphs_train_as_the_compiled_model_launched_kernel_by_kernel():
    """trainer.cuda_graphs (auto for ViT-Ti/S on one GPU): the whole model compiled and replayed as
    CUDA graphs (torch's graph trees) gives the losses and weights of the same compiled model
    launched kernel by kernel, over 30 steps of fused AdamW in bf16 with a new batch each step and
    no host synchronisation between them (the losses are read at the end): a replay that read a
    stale input, or wrote an output a later step still reads, would part the two. In-process, but
    here rather than in tests/unit: Inductor starts its compile workers as processes."""
    from visiondist.models.vit import VisionTransformer
    from visiondist.parallel import compile_model

    def build(graphs: bool):
        torch.manual_seed(0)
        model = (
            VisionTransformer(
                img_size=64, patch_size=16, num_classes=10, embed_dim=192, depth=2, num_heads=3
            )
            .cuda()
            .train()
        )
        compile_model(model, cuda_graphs=graphs)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [
        (
            torch.randn(32, 3, 64, 64, device="cuda", generator=g),
            torch.randint(0, 10, (32,), device="cuda", generator=g),
        )
        for _ in range(30)
    ]
    runs = []
    for graphs in (False, True):
        model, optimizer = build(graphs)
        losses = []
        for x, y in batches:
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        runs.append(
            (torch.stack(losses).tolist(), [p.detach().clone() for p in model.parameters()])
        )
    (eager_losses, eager_weights), (graph_losses, graph_weights) = runs
    assert graph_losses == pytest.approx(eager_losses, rel=2e-3)
    assert eager_losses[-1] < eager_losses[0]  # it trained
    for a, b in zip(eager_weights, graph_weights):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-4)
