"""model.sdpa=auto on CUDA times the fused attention kernels at the run's shape and lets torch try
them fastest first (visiondist/models/sdpa.py). The CPU has one fused kernel and ignores torch's
order, so here the timing, the order torch is given and the shape a run measures are checked;
tests/unit/test_gpu.py checks that CUDA runs the first."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import REPO

from visiondist.config.layout import RunLayout
from visiondist.models.sdpa import describe, fastest_first, select_attention, time_kernels

CONFIGS = REPO / "configs"


def _torch_order() -> list[int]:
    return list(torch._C._get_sdp_priority_order())


@pytest.fixture(autouse=True)
def _restore():
    yield
    select_attention("auto")


def test_kernels_are_timed_and_those_that_cannot_run_say_so():
    times = time_kernels(
        (2, 3, 17, 8), torch.float32, torch.device("cpu"), ("flash", "cudnn", "math"), steps=2
    )
    # the CPU's fused kernel and the reference both run here
    assert times["flash"] > 0 and times["math"] > 0
    assert times["cudnn"] is None  # a CUDA kernel: torch has no kernel for CPU tensors under it
    assert fastest_first(times) == sorted(["flash", "math"], key=times.get)
    text = describe(times, (2, 3, 17, 8), torch.float32)
    assert (
        "2x3x17x8 float32" in text
        and "(cudnn cannot run it)" in text
        and f"{fastest_first(times)[0]} runs first" in text
    )


def test_the_measured_order_is_torch_order_and_every_kernel_stays_allowed():
    from torch.nn.attention import SDPBackend

    default = _torch_order()
    select_attention("auto", ["cudnn", "flash"])
    order = _torch_order()
    assert order[:2] == [int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION)]
    assert sorted(order) == sorted(default)  # the rest follow, none dropped
    assert torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    select_attention("auto")
    assert _torch_order() == default  # auto without a measurement: torch's own order again
    select_attention("flash", ["cudnn"])  # a named kernel ignores an order: only it is allowed
    assert _torch_order() == default and not torch.backends.cuda.cudnn_sdp_enabled()


def test_a_run_measures_its_own_shape_micro_batch_heads_per_tp_rank_and_dtype(monkeypatch, caplog):
    """vit_base under tp=2, dp=2, 2 accumulation steps, global batch 64, bf16: 16 images x 6 heads x
    197 tokens x 64."""
    import visiondist.models.sdpa as sdpa
    from visiondist.cli import load_config
    from visiondist.engine.build import order_attention

    seen = {}

    def fake_time(shape, dtype, device, names):
        seen.update(shape=shape, dtype=dtype)
        return {"flash": 2e-3, "cudnn": 1e-3, "efficient": None}

    monkeypatch.setattr(sdpa, "time_kernels", fake_time)
    cfg = load_config(
        CONFIGS,
        [
            "model=vit_base",
            "data.img_size=224",
            "data.batch_size=64",
            "trainer.grad_accum=2",
            "trainer.precision=bf16",
        ],
        inputs=None,
    )
    run = RunLayout(accelerator="cuda", world_size=4, per_node=4, dp=2, tp=2)
    layout = SimpleNamespace(run=run, device=torch.device("cpu"), is_main=True)
    with caplog.at_level(logging.INFO):
        order_attention(cfg, layout)
    assert seen == {"shape": (16, 6, 197, 64), "dtype": torch.bfloat16}
    assert _torch_order()[:2] == [
        int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
        int(torch.nn.attention.SDPBackend.FLASH_ATTENTION),
    ]
    assert (
        "cudnn 1.000 ms < flash 2.000 ms" in caplog.text
        and "(efficient cannot run it)" in caplog.text
    )
    detector = load_config(
        CONFIGS, ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco"], inputs=None
    )
    # no blocks the planner knows: nothing timed, torch's order kept
    order_attention(detector, layout)
    assert len(seen) == 2


@pytest.mark.parametrize("kernel", ["efficient", "cudnn"])
def test_a_cuda_only_kernel_on_the_cpu_is_refused_before_the_ranks_start(kernel):
    from visiondist.cli import load_config
    from visiondist.config import ConfigError
    from visiondist.plan import resolve

    cfg = load_config(CONFIGS, [f"model.sdpa={kernel}", "trainer.accelerator=cpu"], inputs=None)
    with pytest.raises(
        ConfigError, match=f"model.sdpa={kernel} is a CUDA attention kernel .* use model.sdpa=auto"
    ):
        resolve(cfg, env={}, cuda_devices=0)
    resolve(
        load_config(CONFIGS, ["model.sdpa=flash", "trainer.accelerator=cpu"], inputs=None),
        env={},
        cuda_devices=0,
    )
