"""A layout named by hand, fitted to the device before any rank starts (`visiondist.plan.fit`): the
planner's levers ranked by its time model, the refusals, and the one line of a CUDA out-of-memory.
The tools' command lines that reach it: tests/unit/test_fit_tools.py; training under a fitted
layout: tests/multirank/test_fit.py."""

from pathlib import Path

import pytest
import torch

from visiondist.config import ConfigError, compose
from visiondist.config.layout import RunLayout
from visiondist.plan import resolve, resolve_on
from visiondist.plan.fit import out_of_memory_cause
from visiondist.plan.resolve import layout_memory

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# the README's used-by command at ImageNet scale: ViT-H/14, 224 px, global batch 1024, bf16, on 4 x
# 80 GB GPUs
README = [
    "model=vit_huge",
    "parallel=tp4",
    "data=imagenet",
    "data.root=/data",
    "data.num_classes=1000",
    "trainer.precision=bf16",
    "parallel.device_memory_gb=80",
]


def _cfg(*overrides):
    return compose(CONFIGS, [*README, *overrides])


def test_the_readme_command_at_imagenet_scale_is_fitted_by_accumulation():
    cfg = _cfg()
    run = resolve_on(cfg, 4, 1)
    # what was named stays
    assert (run.dp, run.tp, run.pp, run.activation_checkpointing) == (1, 4, 1, False)
    assert run.grad_accum == 4  # the global batch kept: 1024 = 4 micro-batches of 256
    assert (
        layout_memory(cfg, run).device
        <= 0.9 * 80e9
        < layout_memory(cfg, run.replace(grad_accum=1)).device
    )
    assert run.fitted == (
        "parallel.fit=auto: the named layout dp=1 tp=4 pp=1 (4 devices of 80 GB) plans 199 GB a "
        "device, over the 72 GB budget (90% of 80 GB: parallel.device_memory_gb)"
        "; plain DDP plans 111 GB: here each of the dp=1 ranks computes 4x a ddp4 rank's images "
        "(micro-batch 1024 a rank) and tp=4 splits only their attention and MLP activations "
        "(parallel.sequence_parallel=true splits the rest)"
        ": fitted with "
        "trainer.grad_accum=4 (micro-batch 256 a rank): 51.8 GB planned, about 1.00x the step "
        "time in the time model (parallel.fit=refuse stops instead); parallel=auto would choose "
        "ddp4 +accum2 on these devices, about 0.50x this step in the time model"
    )
    assert "+accumulation x4" in run.describe()


def test_refuse_names_the_settings_that_fit_each_lever_once():
    with pytest.raises(ConfigError) as refused:
        resolve_on(_cfg("parallel.fit=refuse"), 4, 1)
    assert str(refused.value) == (
        "parallel.fit=refuse: the named layout dp=1 tp=4 pp=1 (4 devices of 80 GB) plans 199 GB a "
        "device, over the 72 GB budget (90% of 80 GB: parallel.device_memory_gb)"
        "; plain DDP plans 111 GB: here each of the dp=1 ranks computes 4x a ddp4 rank's images "
        "(micro-batch 1024 a rank) and tp=4 splits only their attention and MLP activations "
        "(parallel.sequence_parallel=true splits the rest)"
        "; settings that "
        "fit: trainer.grad_accum=4 (51.8 GB, 1.00x the step); trainer.grad_accum=4 "
        "parallel.activation_checkpointing=true parallel.checkpoint_keep=matmuls (47.7 GB, 1.06x "
        "the step); parallel.activation_checkpointing=true (53.4 GB, 1.25x the step) "
        "(parallel.fit=auto adds the first)"
    )
    # each one does fit
    for settings in ("trainer.grad_accum=4", "parallel.activation_checkpointing=true"):
        run = resolve_on(_cfg("parallel.fit=refuse", *settings.split()), 4, 1)
        assert not run.fitted and layout_memory(_cfg(*settings.split()), run).device <= 0.9 * 80e9


def test_off_runs_as_named_and_says_so_in_its_line():
    run = resolve_on(_cfg("parallel.fit=off"), 4, 1)
    assert (run.grad_accum, run.activation_checkpointing) == (1, False)
    assert run.fitted.startswith(
        "parallel.fit=off: the named layout dp=1 tp=4 pp=1 (4 devices of 80 GB) plans 199 GB"
    )
    # printed once a job, logged, kept in layout.json
    assert run.fitted.endswith("; it runs as named, unfitted")


def test_what_fits_no_way_is_refused_naming_the_layouts_that_would():
    # ViT-H's state alone, split 4 ways, is 2.56 GB a device
    with pytest.raises(ConfigError) as refused:
        resolve_on(_cfg("parallel.device_memory_gb=2"), 4, 1)
    text = str(refused.value)
    assert text.startswith(
        "the named layout dp=1 tp=4 pp=1 (4 devices of 2 GB) plans 199 GB a device, over the 1.8 "
        "GB budget (90% of 2 GB: parallel.device_memory_gb)"
        "; plain DDP plans 111 GB: here each of the dp=1 ranks computes 4x a ddp4 rank's images "
        "(micro-batch 1024 a rank) and tp=4 splits only their attention and MLP activations "
        "(parallel.sequence_parallel=true splits the rest)"
        ", and no accumulation or checkpointing "
        "fits it: layouts that fit these devices: "
    ), text
    assert (
        "parallel.fsdp=true parallel.offload=true" in text
        and "tools/plan.py shows them all" in text
    )


def test_checkpointing_when_accumulation_would_starve_the_matmuls():
    # ViT-B at 8 images on one 1.8 GB device: accumulating to fit would leave 1-image micro-batches
    # (2x the step in the time model), whole-block checkpointing costs a third more
    run = resolve_on(
        _cfg(
            "model=vit_base", "parallel=ddp", "data.batch_size=8", "parallel.device_memory_gb=1.8"
        ),
        1,
        1,
    )
    assert (run.grad_accum, run.activation_checkpointing, run.checkpoint_keep) == (1, True, "input")
    assert run.checkpoint_blocks == 12
    assert "fitted with parallel.activation_checkpointing=true (micro-batch 8 a rank)" in run.fitted
    assert "about 1.33x the step time" in run.fitted


def test_a_pipeline_left_to_its_default_micro_batch_count_gets_more_micro_batches():
    # pp named on top of auto
    cfg = _cfg("parallel=auto", "parallel.pp=2", "parallel.device_memory_gb=40")
    run = resolve_on(cfg, 2, 1)
    # a smaller bubble, too: 0.87x the step
    assert (run.pp, run.grad_accum, run.microbatches) == (2, 1, 32)
    assert (
        "fitted with parallel.microbatches=32 (micro-batch 32 a rank)" in run.fitted
        and "0.87x" in run.fitted
    )
    # pp2.yaml names 4 micro-batches
    named = resolve_on(_cfg("parallel=pp2", "parallel.device_memory_gb=40"), 2, 1)
    assert (named.microbatches, named.grad_accum) == (4, 4)


def test_named_checkpointing_is_kept_and_only_accumulation_added():
    run = resolve_on(
        _cfg(
            "parallel.activation_checkpointing=true",
            "parallel.checkpoint_keep=matmuls",
            "parallel.device_memory_gb=48",
        ),
        4,
        1,
    )
    assert (run.activation_checkpointing, run.checkpoint_keep) == (True, "matmuls")
    assert run.grad_accum > 1 and "fitted with trainer.grad_accum=" in run.fitted


def test_mixup_keeps_micro_batches_even():
    cfg = _cfg(
        "parallel=auto",
        "parallel.pp=2",
        "parallel.microbatches=2",
        "data.batch_size=96",
        "data.mixup=0.8",
        "parallel.device_memory_gb=8",
    )
    run = resolve_on(cfg, 2, 1)
    assert 96 // (run.grad_accum * run.microbatches) % 2 == 0 and run.fitted


def test_sequence_parallelism_is_named_only_where_it_is_off():
    """The named tp4 plans more a device than plain DDP (the README's case above); with
    sequence parallelism on, the line still says why (4x the images a rank), without naming it."""
    run = resolve_on(_cfg("parallel.sequence_parallel=true"), 4, 1)
    assert "+SP" in run.describe() and "plain DDP plans 111 GB" in run.fitted
    assert "sequence_parallel" not in run.fitted
    # a layout at or under plain DDP's figure: nothing to explain
    assert (
        "plain DDP"
        not in resolve_on(_cfg("parallel.device_memory_gb=40", "parallel=ddp"), 4, 1).fitted
    )


def test_nothing_is_checked_on_the_cpu_without_a_device_budget_nor_for_a_detector():
    named = compose(CONFIGS, ["trainer.accelerator=cpu", "model=vit_small", "parallel=tp2"])
    run, _ = resolve(named, {}, 0)
    assert run.fitted == "" and run.grad_accum == 1
    detector = compose(
        CONFIGS,
        [
            "trainer.accelerator=cpu",
            "model=fasterrcnn_mobilenet_v3",
            "data=shapes_coco",
            "parallel=ddp",
            "parallel.device_memory_gb=0.001",
        ],
    )
    assert resolve(detector, {}, 0)[0].fitted == ""


def test_a_layout_named_on_top_of_auto_is_fitted_not_replanned():
    # ViT-S tp2 plans 0.383 GB a device; 0.35 GB devices (0.315 budget) need a lever, and tp2 stays
    cfg = compose(
        CONFIGS,
        [
            "trainer.accelerator=cpu",
            "model=vit_small",
            "parallel.tp=2",
            "trainer.devices=2",
            "parallel.device_memory_gb=0.35",
        ],
    )
    run, plan = resolve(cfg, {}, 0)
    assert plan is None and run.chosen_by != "parallel=auto"
    assert (run.dp, run.tp, run.pp) == (1, 2, 1) and run.fitted
    assert layout_memory(cfg, run).device <= 0.9 * 0.35e9


def test_the_fitted_layout_is_what_layout_json_records(tmp_path):
    run = resolve_on(_cfg(), 4, 1)
    run.save(tmp_path)
    loaded = RunLayout.load(tmp_path)
    assert loaded == run and loaded.grad_accum == 4 and loaded.fitted == run.fitted
    old = RunLayout.from_json(
        {k: v for k, v in run.to_json().items() if k not in ("grad_accum", "fitted")}
    )
    assert old.grad_accum == 0  # a layout.json from before: the config's trainer.grad_accum


def test_a_cuda_out_of_memory_is_one_clause_the_plan_and_what_fits_with_more_room():
    cfg = _cfg()
    run = resolve_on(cfg, 4, 1)
    error = torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.19 GiB "
        "of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB "
        "memory in use. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
    assert out_of_memory_cause(cfg, run, error) == (
        "CUDA out of memory (tried to allocate 2.00 GiB; 1.06 GiB of 79.19 GiB free): the plan "
        "put dp=1 tp=4 pp=1 (4 devices of 80 GB) +accumulation x4 at 51.8 GB a device (72 GB "
        "budget); planned at 3/4 of that: trainer.grad_accum=8 (27.3 GB), or "
        "parallel.headroom=0.48, with which the fit finds such settings by itself"
    )
    margin = resolve_on(_cfg("parallel.headroom=0.48"), 4, 1)  # what the line says
    assert margin.grad_accum == 8 and layout_memory(cfg, margin).device <= 0.48 * 80e9
