"""Training under a named layout fitted to the device (`visiondist.plan.fit`), on gloo ranks with a
small `parallel.device_memory_gb` that forces the fit: accumulation is exact under DDP, tp2, pp2 and
FSDP2 (each fitted run equals its unaccumulated run to fp32 round-off), a fitted run trains as the
same settings asked for by hand, and SLURM's script fits or refuses before any rank starts.

Every run here names whole-block activation checkpointing (exact: the gradients are the unchecked
model's), which leaves accumulation the fit's only lever: for a ViT this tiny (5 tokens an image),
the time model would otherwise rank checkpointing first, as it does for small micro-batches on a GPU
(tests/unit/test_fit.py)."""

from __future__ import annotations

import json

import fit_ranks
import pytest
import yaml
from helpers import (
    REPO,
    evals_of,
    fake_slurm,
    losses_of,
    random_imagefolder,
    run_together,
    spawn_ranks,
    train_args,
)

# one launch of ranks for the module's runs, on one worker
pytestmark = pytest.mark.xdist_group("fit")
# every layout matches one process in fp32 within this (tests/multirank/test_tensor_parallel.py)
FP32_ROUND_OFF = 1e-5
COMMON = ["model.num_heads=2", "trainer.max_steps=3", "parallel.activation_checkpointing=true"]
LAYOUTS = {
    "ddp2": ["parallel.dp=2"],
    "tp2": ["parallel=tp2"],
    "pp2": ["parallel=pp2"],
    "fsdp2": ["parallel=fsdp", "parallel.dp=2"],
}


def _between_accumulations(args: list[str], ranks: int) -> float:
    """A device size (GB) on which the layout of `args` fits with trainer.grad_accum=2 and not
    without it."""
    from visiondist.config import compose
    from visiondist.plan import resolve_on
    from visiondist.plan.resolve import layout_memory

    cfg = compose(
        REPO / "configs",
        [a for a in args if not a.startswith(("trainer.run_dir", "trainer.accelerator"))],
    )
    run = resolve_on(cfg, ranks, 1)
    one, two = (layout_memory(cfg, run.replace(grad_accum=a)).device for a in (1, 2))
    assert two < one
    return (one + two) / 2 / 0.9 / 1e9


@pytest.fixture(scope="module")
def fit_runs(tmp_path_factory, tiny_shapes):
    """Each layout unaccumulated (nothing checked: the CPU without a device budget) and fitted to a
    device that needs accumulation 2; then DDP with trainer.grad_accum=2 by hand. One launch of 2
    ranks runs them all."""
    root = tmp_path_factory.mktemp("fit")
    cases, names = [], []
    for name, layout in LAYOUTS.items():
        plain = train_args(tiny_shapes, root / name, *COMMON, *layout)
        gb = _between_accumulations(plain, 2)
        cases += [
            plain,
            train_args(
                tiny_shapes,
                root / f"{name}-fitted",
                *COMMON,
                *layout,
                f"parallel.device_memory_gb={gb:.6f}",
            ),
        ]
        names += [name, f"{name}-fitted"]
    cases.append(
        train_args(
            tiny_shapes, root / "ddp2-by-hand", *COMMON, "parallel.dp=2", "trainer.grad_accum=2"
        )
    )
    names.append("ddp2-by-hand")
    results = spawn_ranks(fit_ranks.runs, 2, cases, timeout=420)
    return root, dict(zip(names, results[0]))


@pytest.mark.layouts
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_step_fitted_by_accumulation_equals_the_unaccumulated_step(fit_runs, name):
    root, results = fit_runs
    assert results[name] == {"grad_accum": 1, "fitted": ""}
    fitted = results[f"{name}-fitted"]
    assert (
        fitted["grad_accum"] == 2
        and "fitted with trainer.grad_accum=2 (micro-batch" in fitted["fitted"]
    )
    losses, ref = losses_of(root / f"{name}-fitted"), losses_of(root / name)
    assert sorted(losses) == [1, 2, 3]
    assert [losses[s] for s in losses] == pytest.approx(
        [ref[s] for s in losses], rel=FP32_ROUND_OFF
    )
    got, want = (
        evals_of(root / f"{name}-fitted", "val_loss")[3],
        evals_of(root / name, "val_loss")[3],
    )
    assert got == pytest.approx(want, rel=FP32_ROUND_OFF)
    log = (root / f"{name}-fitted" / "train.log").read_text()
    assert "parallel.fit=auto: the named layout" in log and "x 2 accumulation" in log


def test_a_run_fitted_by_accumulation_trains_as_the_same_settings_asked_by_hand(fit_runs):
    root, _ = fit_runs
    # the same computation, bit for bit
    assert losses_of(root / "ddp2-fitted") == losses_of(root / "ddp2-by-hand")


def test_slurm_script_fits_each_task_alike_and_refuses_before_any_rank(
    tmp_path, tiny_shapes, fit_runs
):
    """tools/slurm_train.sh under a stand-in srun (2 nodes x 1 task): every task fits the named
    layout alike (rank 0 says so once) and the job trains as the fitted run launched here; the
    README's command at ImageNet scale with parallel.fit=refuse (1 node x 4 tasks): every task stops
    before a rank starts, with the refusal's one line."""
    root, _ = fit_runs
    run = tmp_path / "slurm_run"
    gb = _between_accumulations(train_args(tiny_shapes, run, *COMMON, "parallel.dp=2"), 2)
    args = [
        a
        for a in train_args(
            tiny_shapes, run, *COMMON, "parallel.dp=2", f"parallel.device_memory_gb={gb:.6f}"
        )
        if not a.startswith("trainer.run_dir")
    ]
    script = ["bash", str(REPO / "tools" / "slurm_train.sh")]
    (result,) = run_together(
        [[*script, *args]],
        timeout=300,
        envs=[fake_slurm(tmp_path / "bin", "4244", nodes=2, per_node=1, run_dir=run)],
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("parallel.fit=auto: the named layout dp=2 tp=1 pp=1") == 1, (
        result.stdout[-4000:]
    )
    assert losses_of(run) == losses_of(root / "ddp2-fitted")
    asked = yaml.safe_load((run / "config.yaml").read_text())
    ran = json.loads((run / "layout.json").read_text())
    # config.yaml: as asked; layout.json: as run
    assert asked["trainer"]["grad_accum"] == 1 and ran["grad_accum"] == 2
    # the README's command at ImageNet scale, 4 tasks of one node planning 80 GB GPUs: every task
    # refuses it before its rank starts, naming the settings that fit
    # one global batch of 1024
    imagenet = random_imagefolder(tmp_path / "imagenet", 4, train_per_class=256)
    readme = [
        "model=vit_huge",
        "parallel=tp4",
        "data=imagenet",
        f"data.root={imagenet}",
        "trainer.precision=bf16",
        "trainer.accelerator=cpu",
        "parallel.device_memory_gb=80",
        "parallel.fit=refuse",
    ]
    refused_dir = tmp_path / "refused"
    (refused,) = run_together(
        [[*script, *readme]],
        timeout=120,
        envs=[fake_slurm(tmp_path / "bin", "4245", nodes=1, per_node=4, run_dir=refused_dir)],
    )
    assert refused.returncode == 2, refused.stdout[-4000:]
    line = (
        "error: parallel.fit=refuse: the named layout dp=1 tp=4 pp=1 (4 devices of 80 GB) plans "
        "199 GB a device, over the 72 GB budget (90% of 80 GB: parallel.device_memory_gb); "
        "plain DDP plans 111 GB: here each of the dp=1 ranks computes 4x a ddp4 rank's images "
        "(micro-batch 1024 a rank) and tp=4 splits only their attention and MLP activations "
        "(parallel.sequence_parallel=true splits the rest); settings that fit: "
        "trainer.grad_accum=4 "
    )
    # each task, no rank
    assert refused.stdout.count(line) == 4 and not refused_dir.exists(), refused.stdout[-4000:]
