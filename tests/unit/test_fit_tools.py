"""The README's used-by command at ImageNet scale (`model=vit_huge parallel=tp4 data=imagenet
trainer.precision=bf16` on 4 x 80 GB GPUs: 199 GB a device as named) through the tools that plan it
before any rank starts, each run in-process as a user runs it: tools/train.py (fitted, then, on this
machine without GPUs, stopped by the CPU estimate before a rank starts), tools/plan.py (the fit, and
the dry run of the fitted layout against the plan) and tools/k8s.py (the manifest, each pod fitting
it alike). SLURM's script: tests/multirank/test_fit.py."""

import importlib.util

import pytest
from helpers import REPO, random_imagefolder

README = [
    "model=vit_huge",
    "parallel=tp4",
    "data=imagenet",
    "trainer.precision=bf16",
    "parallel.device_memory_gb=80",
]
FITTED = (
    "parallel.fit=auto: the named layout dp=1 tp=4 pp=1 (4 devices of 80 GB) plans 199 GB a "
    "device, over the 72 GB budget (90% of 80 GB: parallel.device_memory_gb)"
    # why tp4 plans more than DDP: 4x the images a rank, its activations split only in part
    "; plain DDP plans 111 GB: here each of the dp=1 ranks computes 4x a ddp4 rank's images "
    "(micro-batch 1024 a rank) and tp=4 splits only their attention and MLP activations "
    "(parallel.sequence_parallel=true splits the rest)"
    ": fitted with "
    "trainer.grad_accum=4 (micro-batch 256 a rank): 51.8 GB planned, about 1.00x the step time in "
    "the time model (parallel.fit=refuse stops instead); parallel=auto would choose ddp4 +accum2 "
    "on these devices, about 0.50x this step in the time model"
)


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(
        f"{name}_tool_under_test", REPO / "tools" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    """An ImageNet-format tree with one global batch of training images (the run checks it holds
    one)."""
    return random_imagefolder(tmp_path_factory.mktemp("imagenet"), 4, train_per_class=256)


def test_train_fits_the_readme_command_before_any_rank_starts(imagenet, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # as many steps as README's run on ImageNet takes (3 epochs of 1,251 global batches; this tree
    # holds one): the CPU estimate is then days on any CPU and thread count, not an hour's worth
    # that a fast one might come under
    args = [
        *README,
        f"data.root={imagenet}",
        "trainer.devices=4",
        f"trainer.run_dir={run_dir}",
        "trainer.max_epochs=3753",
    ]
    # fitted, then stopped: no GPU here, the CPU would take days
    assert _tool("train").main(args) == 2
    captured = capsys.readouterr()
    assert FITTED in captured.out.replace("\n", " ")
    # nothing started, nothing written
    assert "no GPU was found" in captured.err and not run_dir.exists()
    assert _tool("train").main([*args, "parallel.fit=refuse"]) == 2
    refused = capsys.readouterr()
    assert (
        "error: parallel.fit=refuse: the named layout dp=1 tp=4 pp=1 (4 devices of 80 GB) plans "
        "199 GB a device"
        in refused.err
        and "settings that fit: trainer.grad_accum=4 (51.8 GB" in refused.err
    )
    assert "parallel.fit=auto:" not in refused.out
    # runs as named, said in one line (then no GPU here)
    assert _tool("train").main([*args, "parallel.fit=off"]) == 2
    assert "parallel.fit=off: the named layout dp=1 tp=4 pp=1" in capsys.readouterr().out


def test_plan_fits_it_and_the_dry_run_of_the_fitted_layout_matches_the_plan(capsys):
    from visiondist.config import compose
    from visiondist.models.shape import ViTShape
    from visiondist.plan import resolve_on
    from visiondist.verify.dryrun import dry_run

    assert _tool("plan").main([*README, "trainer.devices=4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"{FITTED} (as tools/train.py decides)" in out
    assert "it runs as dp=1 tp=4 pp=1 (4 devices of 80 GB) +accumulation x4" in out
    # the table's row for the layout as it runs, with its micro-batch
    assert "tp4 +accum4 │ 256 │" in out
    assert _tool("plan").main([*README, "trainer.devices=4", "parallel.fit=refuse"]) == 1
    assert "error: parallel.fit=refuse: the named layout" in capsys.readouterr().out
    # it would run over the budget
    assert _tool("plan").main([*README, "trainer.devices=4", "parallel.fit=off"]) == 1
    assert "; it runs as named, unfitted (as tools/train.py decides)" in " ".join(
        capsys.readouterr().out.split()
    )
    # what `verify=chosen` runs on every rank it picks (here one of the four identical TP ranks):
    # the training code's step accumulates 4 micro-batches of 256, and every figure is the plan's
    cfg = compose(REPO / "configs", [*README, "data.root=/data", "data.num_classes=1000"])
    run = resolve_on(cfg, 4, 1)
    (report,) = dry_run(cfg, ViTShape.from_config(cfg.model), run, ranks=[0])
    # 4 passes of the TP collectives
    assert not report.flagged and report.figure("tp all_reduce").planned > 4 * 30e9


def test_plan_without_a_gpu_says_so_and_a_named_layout_over_its_budget_exits_1(capsys):
    """On a machine with no GPU (a login node; this one), a plan without parallel.device_memory_gb
    is made for the CPU's memory: it says so and how to plan for GPUs, and the named layout, far
    over that budget, is not called within it."""
    args = [a for a in README if not a.startswith("parallel.device_memory_gb")]
    assert _tool("plan").main([*args, "trainer.devices=8", "parallel.nodes=2"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "no GPU on this machine: planned for its CPU memory" in out
    assert "parallel.gpu=h100" in out
    assert "you named dp=4 tp=4 pp=1 (16 devices of" in out and "GB per device, over the" in out
    assert "within the" not in out


@pytest.mark.parametrize(
    "gpu, memory, datasheet, tflops, link, chosen",
    [("a100-40gb", 40, 312, 126.1, 300, "fsdp8"), ("l40s", 48, 362.05, 146.4, 25, "ddp8")],
)
def test_plan_for_a_gpu_by_name_is_the_plan_for_its_memory_and_rate(
    capsys, gpu, memory, datasheet, tflops, link, chosen
):
    """parallel.gpu=a100-40gb plans as its figures given by hand would (40 GB, 0.4 x 312 TFLOP/s,
    NVLink); an L40S's GPUs share PCIe 4 (25 GB/s): the same table and choice, the budget's source
    named, and no "no GPU" note."""
    args = ["model=vit_huge", "data=imagenet", "trainer.precision=bf16", "trainer.devices=8"]
    assert _tool("plan").main([*args, f"parallel.gpu={gpu}"]) == 0
    named = " ".join(capsys.readouterr().out.split())
    by_hand_args = [
        f"parallel.device_memory_gb={memory}",
        f"parallel.device_tflops={tflops}",
        f"parallel.intra_node_gbs={link}",
    ]
    assert _tool("plan").main([*args, *by_hand_args]) == 0
    by_hand = " ".join(capsys.readouterr().out.split())
    assert f"{memory} GB each (parallel.gpu={gpu})" in named and "no GPU" not in named
    # the step times' rate, and where it comes from
    rate = f"step times at {tflops:g} TFLOP/s a device "
    source = f"{rate}(0.4 x the {datasheet:g} TFLOP/s bf16 datasheet figure of parallel.gpu={gpu})"
    assert source in named
    assert f"{rate}(parallel.device_tflops)" in by_hand
    named = named.replace(source, f"{rate}(parallel.device_tflops)")
    assert named.replace(f"(parallel.gpu={gpu})", "(parallel.device_memory_gb)") == by_hand
    assert _tool("plan").main([*args, "parallel.device_memory_gb=40"]) == 0
    unnamed = " ".join(capsys.readouterr().out.split())
    assert (
        "step times at 400 TFLOP/s a device (no GPU named or found here: an H100-class figure; "
        "name yours with parallel.gpu=<board>" in unnamed
    )
    assert f"parallel=auto would choose {chosen}" in named
    assert _tool("plan").main([*args, "parallel.gpu=b300"]) == 2
    assert "parallel.gpu=b300 is not a board the planner knows" in capsys.readouterr().err


def test_k8s_writes_the_job_that_each_pod_fits_alike(tmp_path, capsys):
    out = tmp_path / "job.yaml"
    common = [
        "image=registry.example.com/visiondist:1",
        "nodes=1",
        "gpus=4",
        "data_pvc=imagenet",
        "data.root=/data/imagenet",
        *README,
        f"out={out}",
    ]
    assert _tool("k8s").main(common) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"{FITTED} (each pod decides the same at its start)" in err
    assert "- parallel.device_memory_gb=80" in out.read_text()  # the pods plan with the same figure
    assert _tool("k8s").main([*common, "parallel.fit=refuse"]) == 2
    assert "error: parallel.fit=refuse: the named layout" in capsys.readouterr().err
    assert (
        _tool("k8s").main([a for a in common if not a.startswith("parallel.device_memory_gb")]) == 0
    )
    said = capsys.readouterr().err
    assert "checked by each pod against its GPUs at start; parallel.gpu=<board> (e.g. h100)" in said
    # a board named: the layout the pods run, checked here
    bigger = [a for a in common if not a.startswith(("parallel.device_memory_gb", "gpus="))]
    assert _tool("k8s").main([*bigger, "gpus=8", "parallel.gpu=h200"]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert "the pods run dp=2 tp=4 pp=1 (8 GPUs): it fits their memory as planned here" in said
