"""The fast-path switches (each gives the same numbers as the path it replaces), the step-health
verdicts, the datasheet peaks and the ratio checks. The benchmark tool's real runs:
tests/multirank/test_performance.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO
from omegaconf import OmegaConf

from visiondist.bench.report import ratio_check
from visiondist.engine.optim import build_optimizer, describe_optimizer, resolve_impl
from visiondist.faults.health import StepHealth
from visiondist.models.sdpa import select_attention
from visiondist.models.vit import VisionTransformer
from visiondist.parallel import enable_activation_checkpointing
from visiondist.utils.gpus import board_named, board_of_device
from visiondist.utils.peaks import datasheet_tflops, peak_kind


def test_step_health_verdicts_arrive_in_order_and_one_step_late_on_request():
    health = StepHealth(1, torch.device("cpu"))
    one, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    health.submit(1, 0, one, one, stop=False)
    health.submit(2, 0, nan, one, stop=False)
    health.submit(3, 0, one, nan, stop=True)
    health.submit(4, 0, one, one, stop=False, asked=True, save=True)
    # a stop or a checkpoint due is not a non-finite step (fp16's skip reads this on the device)
    assert health.nonfinite().item() == 0.0
    assert health.pending == 4
    first, second, third, fourth = (health.verdict() for _ in range(4))
    assert (first.step, first.finite, first.stop, first.save) == (1, True, False, False)
    assert (second.step, second.bad_loss_ranks, second.bad_grad) == (2, [0], False)
    assert (third.step, third.bad_loss_ranks, third.bad_grad, third.stop) == (3, [], True, True)
    assert (fourth.finite, fourth.stop, fourth.asked, fourth.save) == (True, False, True, True)
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
        cfg = OmegaConf.create(
            {
                "name": "adamw",
                "lr": 1e-2,
                "weight_decay": 0.05,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "impl": kind,
            }
        )
        opt = build_optimizer(cfg, model)
        images, labels = _batch()
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            opt.step()
        return {
            "state": model.state_dict(),
            "fused": opt.defaults.get("fused"),
            "foreach": opt.defaults["foreach"],
        }

    ref, got = train("auto"), train(impl)
    assert {
        "fused": got["fused"] is True,
        "foreach": got["foreach"] is True,
        "loop": got["foreach"] is False,
    }[impl]
    for name, value in ref["state"].items():
        # its gradient is round-off (softmax ignores a shift of all keys): AdamW
        if name.endswith("attn.k.bias"):
            # normalises that into steps of lr that differ between kernels; see test_tensor_parallel
            continue
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_auto_resolves_to_the_kernel_the_optimizer_runs():
    """On the CPU `auto` is fused (2-6x faster than foreach and the loop there,
    benchmarks/RESULTS.md), and the log and the benchmark name the kernel from the optimizer
    itself."""
    model = _tiny_vit()
    assert resolve_impl("auto", "adamw", model.parameters()) == "fused"
    assert resolve_impl("loop", "adamw", model.parameters()) == "loop"
    cfg = OmegaConf.create(
        {
            "name": "sgd",
            "lr": 0.1,
            "weight_decay": 0.0,
            "momentum": 0.9,
            "nesterov": False,
            "impl": "auto",
        }
    )
    opt = build_optimizer(cfg, model)
    assert opt.defaults["fused"] is True and describe_optimizer(opt, "auto") == "sgd (auto: fused)"
    foreach = build_optimizer(OmegaConf.merge(cfg, {"impl": "foreach"}), model)
    assert describe_optimizer(foreach, "foreach") == "sgd (foreach)"


@pytest.mark.parametrize(
    "name, kind, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H200 NVL", "tf32", 417.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-PCIE-40GB", "tf32", 156.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA A10", "tf32", 62.5),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA A10G", "bf16", None),
        ("NVIDIA L40", "bf16", None),
        ("CPU (AMD EPYC), 2 threads", "fp32", None),
    ],
)
def test_datasheet_peak_by_device_name(name, kind, tflops):
    assert datasheet_tflops(name, kind) == tflops


@pytest.mark.parametrize(
    "device_name, key, memory_gb",
    [
        ("NVIDIA H100 80GB HBM3", "h100", 80.0),
        ("NVIDIA H100 NVL", "h100-nvl", 94.0),
        ("NVIDIA H200", "h200", 141.0),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb", 40.0),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb", 40.0),
        ("NVIDIA H100 80GB HBM3", "h100-sxm", 80.0),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb", 80.0),
        ("NVIDIA L40S", "l40s", 48.0),
    ],
)
def test_a_board_named_in_the_config_is_the_one_its_gpu_reports(device_name, key, memory_gb):
    """parallel.gpu=<key> on a login node plans with what the GPU itself would give on the node."""
    named, found = board_named(key.upper().replace("-", "_")), board_of_device(device_name)
    assert named == found and named.memory_gb == memory_gb
    assert named.sustained_tflops == pytest.approx(found.bf16 * 400 / 989.4, abs=0.05)
    with pytest.raises(ValueError, match=r"parallel.gpu=b300 is not a board .*: use one of h100"):
        board_named("b300")


def test_the_peak_follows_the_precision_of_the_matmuls():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [
        peak_kind("bf16", True, cuda),
        peak_kind("16", True, cuda),
        peak_kind("32", True, cuda),
        peak_kind("32", False, cuda),
        peak_kind("32", True, cpu),
    ] == ["bf16", "fp16", "tf32", "fp32", "fp32"]


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
    """model.sdpa=math turns the fused kernels off (process-wide) and gives the same result; auto
    restores them."""
    model = _tiny_vit()
    images, _ = _batch()
    try:
        select_attention("auto")
        fused = model(images)
        select_attention("math")
        assert (
            not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
        )
        torch.testing.assert_close(model(images), fused, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="model.sdpa='fast'"):
            select_attention("fast")
    finally:
        select_attention("auto")
    assert torch.backends.cuda.flash_sdp_enabled()


def test_channels_last_detector_computes_the_same_losses():
    from visiondist.models import build_model

    cfg = OmegaConf.create(
        {
            "name": "frcnn",
            "family": "torchvision",
            "arch": "fasterrcnn_mobilenet_v3_large_fpn",
            "num_classes": 3,
            "weights": None,
            "min_size": 96,
            "max_size": 96,
            "kwargs": {},
            "anchor_scale": 1.0,
            "roi_sampling_ratio": None,
        }
    )
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 96, 96, generator=g) for _ in range(2)]
    targets = [
        {"boxes": torch.tensor([[10.0, 10.0, 50.0, 60.0]]), "labels": torch.tensor([1])}
        for _ in range(2)
    ]
    losses = []
    for channels_last in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg).train()
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
            assert model.backbone.body["0"][0].weight.is_contiguous(
                memory_format=torch.channels_last
            )
        torch.manual_seed(1)  # the same proposal sampling
        losses.append({k: v.item() for k, v in model(images, targets).items()})
    assert losses[1] == pytest.approx(losses[0], rel=1e-4, abs=1e-6)


def testloader_options_follow_the_config():
    from visiondist.data.loaders import loader_options

    cfg = OmegaConf.create({"num_workers": 2, "pin_memory": False, "prefetch_factor": 6})
    options = loader_options(cfg, pin_memory=True)
    assert (
        options["prefetch_factor"] == 6
        and options["pin_memory"] is False
        and options["persistent_workers"]
    )
    options = loader_options(
        OmegaConf.create({"num_workers": 0, "pin_memory": True, "prefetch_factor": 6}), True
    )
    assert options["prefetch_factor"] is None and options["pin_memory"] is True


def test_compile_auto_compiles_on_cuda_only_where_it_can_the_whole_model_where_the_layout_keeps_it(
    monkeypatch,
):
    """trainer.compile=auto (the default): on CUDA with Triton; never on the CPU, never a detector
    without blocks (not refused either), never under the zero-bubble schedule or without Triton;
    each time with the reason. The scope is the whole model on one device and under DDP, each block
    under TP, a pipeline, FSDP, or for ViTDet; model / blocks name it, and model under TP is refused
    naming blocks. CUDA graphs (auto) for a ViT up to 384 wide on one GPU with one micro-batch a
    step; true where they cannot run is refused with the reason. The layout says it all."""
    import torch.utils._triton as triton

    from visiondist.cli import load_config
    from visiondist.config import ConfigError
    from visiondist.config.layout import RunLayout
    from visiondist.plan.compiling import compile_choice, compile_plan

    def cfg(*extra):
        return load_config(REPO / "configs", list(extra), inputs=None)

    def plan(*extra, run=RunLayout("cuda", 1, 1, 1)):
        compiled, scope, graphs, _ = compile_plan(cfg(*extra), run)
        return compiled, scope, graphs

    monkeypatch.setattr(triton, "has_triton", lambda: True)
    assert cfg().trainer.compile == "auto" and cfg().trainer.cuda_graphs == "auto"
    assert compile_choice(cfg("model=vit_base"), "cuda") == (True, "compiled on CUDA")
    assert compile_choice(cfg("model=vit_base"), "cpu")[0] is False
    assert (
        "no transformer blocks"
        in compile_choice(cfg("model=fasterrcnn_r50", "data=shapes_coco"), "cuda")[1]
    )
    assert (
        "zero-bubble"
        in compile_choice(
            cfg("model=vit_base", "parallel=pp2", "parallel.schedule=zero_bubble"), "cuda"
        )[1]
    )
    assert compile_choice(cfg("model=vit_base", "trainer.compile=false"), "cuda")[0] is False
    assert compile_choice(cfg("model=vit_base", "trainer.compile=true"), "cpu")[0] is True

    # the scope, and CUDA graphs where the step is launch-bound
    assert plan("model=vit_small") == (True, "model", True)
    assert plan("model=vit_tiny") == (True, "model", True)
    assert plan("model=vit_base") == (True, "model", False)  # 768 wide: the GPU is busy
    # DDP: one GPU only
    assert plan("model=vit_small", run=RunLayout("cuda", 2, 2, 2)) == (True, "model", False)
    assert plan("model=vit_small", "trainer.grad_accum=2", "data.batch_size=64") == (
        True,
        "model",
        False,
    )
    assert plan("model=vit_small", "trainer.fp8=rowwise", "trainer.precision=bf16") == (
        True,
        "model",
        False,
    )
    assert plan("model=vit_small", "trainer.cuda_graphs=false") == (True, "model", False)
    assert plan("model=vit_base", "trainer.cuda_graphs=true") == (True, "model", True)
    # ViT-L / H: per block (GPU-bound either way; one block compiles in seconds, the whole graph in
    # minutes)
    assert plan("model=vit_huge") == (True, "blocks", False)
    assert plan("model=vit_large", "trainer.compile=true") == (True, "blocks", False)
    assert plan("model=vit_huge", "trainer.compile=model") == (True, "model", False)
    assert (
        "one block in seconds" in compile_plan(cfg("model=vit_huge"), RunLayout("cuda", 1, 1, 1))[3]
    )
    assert plan("model=vit_base", "parallel=tp2", run=RunLayout("cuda", 2, 2, 1, tp=2)) == (
        True,
        "blocks",
        False,
    )
    assert plan("model=vit_base", "parallel=pp2", run=RunLayout("cuda", 2, 2, 1, pp=2)) == (
        True,
        "blocks",
        False,
    )
    assert plan(
        "model=vit_base", "parallel.fsdp=true", run=RunLayout("cuda", 2, 2, 2, fsdp=True)
    ) == (True, "blocks", False)
    assert plan("model=vitdet_small", "data=shapes_coco") == (True, "blocks", False)
    assert plan("model=vit_small", "trainer.compile=blocks") == (True, "blocks", False)
    assert plan("model=vit_small", "trainer.compile=false") == (False, "none", False)
    # auto: eager on the CPU
    assert plan("model=vit_small", run=RunLayout("cpu", 1, 1, 1)) == (False, "none", False)
    with pytest.raises(
        ConfigError,
        match=r"trainer.cuda_graphs=true replays the compiled model, and nothing is "
        r"compiled here \(on the CPU",
    ):
        plan("model=vit_small", "trainer.cuda_graphs=true", run=RunLayout("cpu", 1, 1, 1))
    assert (
        "the whole model compiled in one graph"
        in compile_plan(cfg("model=vit_base"), RunLayout("cuda", 1, 1, 1))[3]
    )
    assert "CUDA graphs" in compile_plan(cfg("model=vit_small"), RunLayout("cuda", 1, 1, 1))[3]
    with pytest.raises(
        ConfigError,
        match=r"trainer.compile=model .* tensor parallelism .* use trainer.compile=blocks",
    ):
        plan(
            "model=vit_base",
            "parallel=tp2",
            "trainer.compile=model",
            run=RunLayout("cuda", 2, 2, 1, tp=2),
        )
    with pytest.raises(
        ConfigError, match=r"trainer.cuda_graphs=true: it runs on one GPU only \(2 ranks here\)"
    ):
        plan("model=vit_small", "trainer.cuda_graphs=true", run=RunLayout("cuda", 2, 2, 2))
    with pytest.raises(
        ConfigError, match=r"trainer.cuda_graphs=true: it compiles the whole model only"
    ):
        plan("model=vit_small", "trainer.cuda_graphs=true", "trainer.compile=blocks")
    with pytest.raises(ConfigError, match=r"trainer.cuda_graphs=true replays the compiled model"):
        cfg("trainer.cuda_graphs=true", "trainer.compile=false")

    monkeypatch.setattr(triton, "has_triton", lambda: False)
    assert "Triton" in compile_choice(cfg("model=vit_base"), "cuda")[1]
    with pytest.raises(ConfigError, match=r"trainer.compile='sometimes': use auto"):
        cfg("trainer.compile=sometimes")
    assert (
        RunLayout("cuda", 1, 1, 1, compile=True).describe()
        == "dp=1 tp=1 pp=1 (1 rank on cuda) +compiled blocks"
    )
    assert (
        RunLayout("cuda", 1, 1, 1, compile=True, compile_scope="model", cuda_graphs=True).describe()
        == "dp=1 tp=1 pp=1 (1 rank on cuda) +compiled model +CUDA graphs"
    )


def test_checkpoint_keep_matmuls_saves_the_matmuls_recomputes_the_rest_with_the_same_gradients():
    """parallel.checkpoint_keep=matmuls: per block the backward reuses what the 4 GEMMs (q, k and v
    fused, the output projection, the MLP's two) and the attention kernel returned (saved in the
    forward, not run again) and recomputes the norms, GELU and drop path, replaying the drop-path
    draws: gradients equal the unchecked model's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    plain, full, keep = _tiny_vit(drop_path=0.2), _tiny_vit(drop_path=0.2), _tiny_vit(drop_path=0.2)
    enable_activation_checkpointing(full)
    assert enable_activation_checkpointing(keep, keep="matmuls") == 3
    images, labels = _batch()
    counts = {}
    for name, model in (("plain", plain), ("input", full), ("matmuls", keep)):
        torch.manual_seed(5)
        loss = F.cross_entropy(model(images), labels)
        with Count() as count:
            loss.backward()
        counts[name] = count.ops
    aten = torch.ops.aten
    matmuls = lambda ops: sum(op in (aten.addmm.default, aten.mm.default) for op in ops)  # noqa: E731

    def attention(ops):
        return sum("scaled_dot_product" in str(op) and "backward" not in str(op) for op in ops)

    gelus = lambda ops: sum(op is aten.gelu.default for op in ops)  # noqa: E731
    # input: each block's 4 GEMMs (but where torch stops recomputing once the backward has what it
    # needs: the last fc2 at most) and its attention run again in the backward; matmuls: none of
    # them do
    assert (
        matmuls(counts["input"]) - matmuls(counts["plain"]) >= 3 * 4 - 1
        and attention(counts["input"]) == 3
    )
    assert (
        matmuls(counts["matmuls"]) == matmuls(counts["plain"]) and attention(counts["matmuls"]) == 0
    )
    # the elementwise work is recomputed
    assert gelus(counts["matmuls"]) == 3 and gelus(counts["plain"]) == 0
    for (name, a), b in zip(plain.named_parameters(), keep.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="parallel.checkpoint_keep='all'"):
        enable_activation_checkpointing(_tiny_vit(), keep="all")


def test_compile_watch_names_graph_breaks_recompile_limit_hits_and_compiling_while_timed():
    """The benchmark's CompileWatch (and the trainer's warning) read dynamo's counters: a graph
    break, a frame past the recompile limit (which then runs eager) and, for timed steps, any new
    graph are faults naming the cause; a clean compiled loop has none."""
    import torch._dynamo

    from visiondist.bench.harness import CompileWatch

    torch._dynamo.reset()

    def clean(x):
        return (x * 2).sin()

    def broken(x):
        x = x * 2
        torch._dynamo.graph_break()
        return x.sin()

    def specialised(x, scale: float):  # a float argument: one graph per value
        return x * scale

    x = torch.randn(4)
    compiled_clean = torch.compile(clean, backend="eager")
    with CompileWatch() as watch:
        compiled_clean(x)
    assert watch.faults == []
    with CompileWatch(timed=True) as watch:  # compiled already: nothing new while timed
        compiled_clean(x)
    assert watch.faults == []
    with CompileWatch() as watch:
        torch.compile(broken, backend="eager")(x)
    assert len(watch.faults) == 1 and "graph_break" in watch.faults[0].lower().replace(" ", "_")
    compiled_specialised = torch.compile(specialised, backend="eager")
    with (
        torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False),
        CompileWatch(timed=True) as watch,
    ):  # torch's own patch: it restores its config as it was
        for scale in (1.5, 2.5, 3.5, 4.5):
            compiled_specialised(x, scale)
    assert any("recompile limit hit" in f for f in watch.faults), watch.faults
    assert any("compiled while timed" in f for f in watch.faults), watch.faults
    torch._dynamo.reset()


def test_compile_autotune_is_each_compiled_modules_own_mode(monkeypatch):
    """trainer.compile_autotune=true: torch.compile's autotuning mode on what is compiled (each
    block, or the whole model, "max-autotune" where CUDA graphs replay it), never Inductor's
    process-wide settings, so that a benchmark's variants compiled side by side keep their own. Each
    mode is one torch knows, and the one without CUDA graphs leaves them to trainer.cuda_graphs."""
    import torch._inductor as inductor

    from visiondist.models.vit import VisionTransformer
    from visiondist.parallel.fsdp import compile_blocks, compile_mode, compile_model

    assert [compile_mode(g, a) for g in (False, True) for a in (False, True)] == [
        None,
        "max-autotune-no-cudagraphs",
        "reduce-overhead",
        "max-autotune",
    ]
    assert inductor.list_mode_options("max-autotune-no-cudagraphs").get("max_autotune") is True
    assert not inductor.list_mode_options("max-autotune-no-cudagraphs").get("triton.cudagraphs")
    assert inductor.list_mode_options("max-autotune").get("triton.cudagraphs") is True
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs) or fn)

    def vit():
        return VisionTransformer(
            img_size=32, patch_size=16, num_classes=3, embed_dim=32, depth=2, num_heads=2
        )

    compile_blocks(vit(), autotune=True)
    compile_blocks(vit())
    compile_model(vit(), autotune=True)
    compile_model(vit(), cuda_graphs=True, autotune=True)
    compile_model(vit(), cuda_graphs=True)
    assert seen == [{"mode": "max-autotune-no-cudagraphs"}] * 2 + [{}] * 2 + [
        {"mode": "max-autotune-no-cudagraphs"},
        {"mode": "max-autotune"},
        {"mode": "reduce-overhead"},
    ]
    assert not inductor.config.max_autotune
