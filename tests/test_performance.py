"""The benchmark tool (real runs, real result files, FLOPs against the analytic count, pipeline traffic against its
analytic bytes) and the fast-path switches (each gives the same numbers as the path it replaces)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from helpers import REPO, TINY_DATA, run_cli
from visiondist.engine.faults import StepHealth
from visiondist.engine.bench_report import ratio_check
from visiondist.engine.optim import build_optimizer, describe_optimizer, resolve_impl
from visiondist.engine.peaks import datasheet_tflops, peak_kind
from visiondist.models.vit import VisionTransformer, select_attention
from visiondist.parallel import enable_activation_checkpointing
from visiondist.parallel.memory import ViTShape
from visiondist.parallel.planner import train_flops_per_image

BENCH = REPO / "tools" / "benchmark.py"


def _bench(tiny_shapes, tmp_path, *extra: str, rows: int = 1, timeout: float = 300) -> list[dict]:
    results = tmp_path / "results"
    args = [*TINY_DATA, f"data.root={tiny_shapes}", "trainer.accelerator=cpu", "trainer.tensorboard=false",
            f"trainer.output_dir={tmp_path / 'runs'}", "bench.warmup=1", "bench.steps=2", "bench.rounds=2",
            "bench.loader_batches=2", f"bench.results_dir={results}", *extra]
    out = run_cli(args, timeout=timeout, script=BENCH)
    assert out.returncode == 0, out.stdout[-4000:]
    lines = (results / "results.jsonl").read_text().splitlines()
    md = (results / "results.md").read_text().splitlines()
    assert len(lines) == rows and len(md) == 2 + rows  # header, rule, a row per configuration
    assert md[0].startswith("| date | device | model")
    return [{**json.loads(line), "md_row": row, "stdout": out.stdout} for line, row in zip(lines, md[2:])]


def test_each_configuration_is_timed_against_its_own_plain_loops_in_alternating_order(tiny_shapes, tmp_path):
    """The compiled variant's plain loops compile their blocks too (visiondist compiles per block), each ratio divides
    by its own configuration's loops, the harness / model split multiplies back to ours / plain, and the order of
    the loops is reversed and the configurations rotated from one round to the next. 4 timed steps: every ratio is
    flagged as not meaningful."""
    first, compiled = _bench(tiny_shapes, tmp_path, "data.batch_size=8", "bench.variants=['trainer.compile=true']",
                             rows=2)
    assert (first["variant"], compiled["variant"]) == ("-", "trainer.compile=true")
    assert first["order"] == [["0:ours", "0:plain_same_model", "0:plain_reference", "1:ours", "1:plain_same_model",
                               "1:plain_reference"],
                              ["1:plain_reference", "1:plain_same_model", "1:ours", "0:plain_reference",
                               "0:plain_same_model", "0:ours"]]
    for r, scope in ((first, "none"), (compiled, "per block (2 blocks)")):
        ref, same = r["plain_reference"], r["plain_same_model"]
        assert (ref["model"], same["model"]) == ("timm vit_tiny_patch16_224", "visiondist VisionTransformer")
        assert ref["built_from"] == same["built_from"] == r["variant"]
        assert r["compile_scope"] == ref["compile_scope"] == same["compile_scope"] == scope
        assert r["optimizer"] == ref["optimizer"] == same["optimizer"] == "adamw (auto: fused)"  # torch >= 2.4, CPU
        assert r["steps_timed"] == ref["steps_timed"] == same["steps_timed"] == 4
        ours_ms, ref_ms, same_ms = r["step"]["median_ms"], ref["step"]["median_ms"], same["step"]["median_ms"]
        assert r["ours_over_plain"] == pytest.approx(ours_ms / ref_ms)
        assert r["harness_overhead"] == pytest.approx(ours_ms / same_ms)
        assert r["model_difference"] == pytest.approx(same_ms / ref_ms)
        assert r["harness_overhead"] * r["model_difference"] == pytest.approx(r["ours_over_plain"])
        assert r["images_per_s"] == pytest.approx(8 / (ours_ms / 1e3))
        # the counted FLOPs of the depth-2 ViT-Ti at 32 px equal the planner's analytic count
        assert r["gflops_per_image"] * 1e9 == pytest.approx(train_flops_per_image(ViTShape(192, 2, 3, 4.0, 16, 32, 6)),
                                                            rel=1e-9)
        assert r["tflops_per_device"] == pytest.approx(r["gflops_per_image"] * r["images_per_s"] / 1e3)
        assert r["peak_kind"] == "fp32" and r["peak_tflops_datasheet"] is None and r["mfu_datasheet"] is None  # CPU
        assert r["mfu_matmul"] == pytest.approx(r["tflops_per_device"] / r["peak_tflops_matmul"])
        assert r["tp_bytes_per_step"] == r["pp_bytes_per_step"] == r["dp_bytes_per_step"] == 0
        assert not r["ratio_reliable"] and "fewer than 5" in r["ratio_warnings"]["harness_overhead"]
        assert f"| {r['batch']} | {r['images_per_s']:.4g} |" in r["md_row"] and "(noisy)" in r["md_row"]
    assert compiled["over_first"] == pytest.approx(compiled["step"]["median_ms"] / first["step"]["median_ms"])
    assert first["loader_images_per_s"] > 0
    out = first["stdout"]
    assert "plain loop, timm" in out and "MFU matmul" in out and "WARNING trainer.compile=true: not meaningful" in out


def test_benchmark_reports_pipeline_traffic_from_the_counter(tiny_shapes, tmp_path):
    """pp2: rank 0 (the first stage) sends each micro-batch's activation once per step; no single-device
    baseline."""
    (r,) = _bench(tiny_shapes, tmp_path, "data.batch_size=16", "parallel=pp2", "parallel.microbatches=2",
                  timeout=400)
    assert r["ranks"] == 2 and r["plain_reference"] is r["plain_same_model"] is r["ours_over_plain"] is None
    micro = 16 // 2  # global batch / micro-batches
    tokens = (32 // 16) ** 2 + 1
    assert r["pp_bytes_per_step"] == 2 * micro * tokens * 192 * 4  # 2 micro-batches forward, fp32
    assert r["tp_bytes_per_step"] == 0


def test_benchmark_variants_that_change_the_layout_are_refused(tmp_path):
    out = run_cli(["bench.variants=['parallel.tp=2']"], timeout=60, script=BENCH)
    assert out.returncode == 2 and "would change the ranks, the mesh or the batch" in out.stdout


def test_step_health_verdicts_arrive_in_order_and_one_step_late_on_request():
    health = StepHealth(1, torch.device("cpu"))
    one, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    health.submit(1, 0, one, one, stop=False)
    health.submit(2, 0, nan, one, stop=False)
    health.submit(3, 0, one, nan, stop=True)
    assert health.pending == 3
    first, second, third = health.verdict(), health.verdict(), health.verdict()
    assert (first.step, first.finite, first.stop) == (1, True, False)
    assert (second.step, second.bad_loss_ranks, second.bad_grad) == (2, [0], False)
    assert (third.step, third.bad_loss_ranks, third.bad_grad, third.stop) == (3, [], True, True)
    assert health.verdict() is None and health.pending == 0


def _tiny_vit(depth: int = 3, drop_path: float = 0.0) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(32, 8, 6, 48, depth, 3, drop_path_rate=drop_path)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 6, (4,), generator=g)


@pytest.mark.parametrize("impl", ["fused", "foreach", "loop"])
def test_optimizer_kernels_give_the_same_weights(impl):
    """optim.impl picks torch's kernels; after 3 AdamW steps all equal the default one."""
    def train(kind: str) -> dict:
        model = _tiny_vit()
        cfg = OmegaConf.create({"name": "adamw", "lr": 1e-2, "weight_decay": 0.05, "betas": [0.9, 0.999],
                                "eps": 1e-8, "impl": kind})
        opt = build_optimizer(cfg, model)
        images, labels = _batch()
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            opt.step()
        return {"state": model.state_dict(), "fused": opt.defaults.get("fused"), "foreach": opt.defaults["foreach"]}

    ref, got = train("auto"), train(impl)
    assert {"fused": got["fused"] is True, "foreach": got["foreach"] is True, "loop": got["foreach"] is False}[impl]
    for name, value in ref["state"].items():
        if name.endswith("attn.k.bias"):  # its gradient is round-off (softmax ignores a shift of all keys): AdamW
            continue  # normalises that into steps of lr that differ between kernels; see test_tensor_parallel
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_auto_resolves_to_the_kernel_the_optimizer_runs():
    """On the CPU `auto` is fused (2-6x faster than foreach and the loop there, benchmarks/RESULTS.md), and the log
    and the benchmark name the kernel from the optimizer itself."""
    model = _tiny_vit()
    assert resolve_impl("auto", "adamw", model.parameters()) == "fused"
    assert resolve_impl("loop", "adamw", model.parameters()) == "loop"
    cfg = OmegaConf.create({"name": "sgd", "lr": 0.1, "weight_decay": 0.0, "momentum": 0.9, "nesterov": False,
                            "impl": "auto"})
    opt = build_optimizer(cfg, model)
    assert opt.defaults["fused"] is True and describe_optimizer(opt, "auto") == "sgd (auto: fused)"
    foreach = build_optimizer(OmegaConf.merge(cfg, {"impl": "foreach"}), model)
    assert describe_optimizer(foreach, "foreach") == "sgd (foreach)"


@pytest.mark.parametrize("name, kind, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
    ("NVIDIA H100 PCIe", "bf16", 756.5), ("NVIDIA H100 NVL", "fp16", 835.5), ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H200 NVL", "tf32", 417.5), ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "tf32", 156.0), ("NVIDIA A100 80GB PCIe", "fp32", 19.5), ("NVIDIA L40S", "bf16", 362.05), ("NVIDIA A10", "tf32", 62.5),
    ("NVIDIA L4", "bf16", 121.0), ("NVIDIA A10G", "bf16", None), ("NVIDIA L40", "bf16", None),
    ("CPU (AMD EPYC), 2 threads", "fp32", None)])
def test_datasheet_peak_by_device_name(name, kind, tflops):
    assert datasheet_tflops(name, kind) == tflops


def test_the_peak_follows_the_precision_of_the_matmuls():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [peak_kind("bf16", True, cuda), peak_kind("16", True, cuda), peak_kind("32", True, cuda),
            peak_kind("32", False, cuda), peak_kind("32", True, cpu)] == ["bf16", "fp16", "tf32", "fp32", "fp32"]


def test_a_ratio_of_spread_or_few_step_times_is_flagged_and_a_tight_one_is_not():
    tight = [1.0 + 0.005 * i for i in range(-5, 5)]  # 10 steps within +-2.5%
    uncertainty, why = ratio_check(tight, [2 * t for t in tight])
    assert why is None and uncertainty < 0.03
    _, why = ratio_check([0.353, 0.860, 8.369], tight)  # the 3 steps, "7.1x slower"
    assert "fewer than 5" in why
    bimodal = [0.35, 0.86] * 5  # 10 steps, half of them 2.5x the others
    uncertainty, why = ratio_check(bimodal, tight)
    assert uncertainty > 0.1 and "spread" in why
    one_stray = tight[:9] + [8.0]  # one slow step moves the median little: still meaningful
    assert ratio_check(one_stray, tight)[1] is None


def test_selective_checkpointing_recomputes_only_the_first_blocks_with_the_same_gradients():
    plain, ckpt = _tiny_vit(drop_path=0.2), _tiny_vit(drop_path=0.2)
    assert enable_activation_checkpointing(ckpt, blocks=2) == 2
    assert [b.checkpointing for b in ckpt.blocks] == [True, True, False]
    images, labels = _batch()
    for model in (plain, ckpt):
        torch.manual_seed(5)  # the same drop-path draws; the recomputation replays them
        F.cross_entropy(model(images), labels).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_attention_kernel_switch():
    """model.sdpa=math turns the fused kernels off (process-wide) and gives the same result; auto restores them."""
    model = _tiny_vit()
    images, _ = _batch()
    try:
        select_attention("auto")
        fused = model(images)
        select_attention("math")
        assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        torch.testing.assert_close(model(images), fused, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="model.sdpa='fast'"):
            select_attention("fast")
    finally:
        select_attention("auto")
    assert torch.backends.cuda.flash_sdp_enabled()


def test_channels_last_detector_computes_the_same_losses():
    from visiondist.models import build_model

    cfg = OmegaConf.create({"name": "frcnn", "family": "torchvision", "arch": "fasterrcnn_mobilenet_v3_large_fpn",
                            "num_classes": 3, "weights": None, "min_size": 96, "max_size": 96, "kwargs": {},
                            "anchor_scale": 1.0, "roi_sampling_ratio": None})
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 96, 96, generator=g) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[10.0, 10.0, 50.0, 60.0]]), "labels": torch.tensor([1])} for _ in range(2)]
    losses = []
    for channels_last in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg).train()
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
            assert model.backbone.body["0"][0].weight.is_contiguous(memory_format=torch.channels_last)
        torch.manual_seed(1)  # the same proposal sampling
        losses.append({k: v.item() for k, v in model(images, targets).items()})
    assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-6)


def test_loader_options_follow_the_config():
    from visiondist.data import _loader_options

    cfg = OmegaConf.create({"num_workers": 2, "pin_memory": False, "prefetch_factor": 6})
    options = _loader_options(cfg, pin_memory=True)
    assert options["prefetch_factor"] == 6 and options["pin_memory"] is False and options["persistent_workers"]
    options = _loader_options(OmegaConf.create({"num_workers": 0, "pin_memory": True, "prefetch_factor": 6}), True)
    assert options["prefetch_factor"] is None and options["pin_memory"] is True
