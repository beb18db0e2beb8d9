"""Pipeline parallelism through `python tools/train.py`: a pp=2 run equals one process accumulating
the same micro-batches (losses, evaluations and final weights), draws its timeline, and its
checkpoint resumes under another layout and evaluates with tools/eval.py."""

import json

import pytest
from helpers import (
    REPO,
    assert_same_training,
    assert_same_weights,
    evals_of,
    losses_of,
    train_args,
    train_ok,
)

from visiondist.checkpoint.files import latest_checkpoint, read_trainer_state

# 4 blocks: 2 stages, or 4 virtual stages for zero-bubble. 16 images per step in 4 micro-batches of
# 4.
EVALS = ("val_loss", "val_top1")  # the evaluation columns compared
COMMON = ["model.num_heads=2", "model.depth=4", "trainer.max_steps=4", "trainer.eval_every=2"]
ONE_PROCESS = ["parallel.dp=1", "trainer.grad_accum=4"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_shapes):
    run = tmp_path_factory.mktemp("pp") / "one"
    train_ok(*train_args(tiny_shapes, run, *COMMON, *ONE_PROCESS, "trainer.checkpoint_every=2"))
    return run


@pytest.mark.layouts
@pytest.mark.smoke
@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_pipelined_run_equals_one_process(tmp_path, tiny_shapes, one_process, schedule):
    run = tmp_path / schedule
    out = train_ok(
        *train_args(tiny_shapes, run, *COMMON, "parallel=pp2", f"parallel.schedule={schedule}")
    )
    stages = 4 if schedule == "zero_bubble" else 2
    assert f"pipeline {schedule}, {stages} stages" in out
    assert_same_training(one_process, run)

    timeline = json.loads((run / "pipeline_timeline.json").read_text())
    assert timeline["step"] == 2 and 0 < timeline["bubble"] < 1
    phases = {e["phase"] for e in timeline["events"]}
    assert phases == ({"F", "I", "W"} if schedule == "zero_bubble" else {"F", "B"})
    # every micro-batch passes forward through every stage once
    forwards = sorted(
        (e["stage"], e["microbatch"]) for e in timeline["events"] if e["phase"] == "F"
    )
    assert forwards == [(s, m) for s in range(stages) for m in range(4)]
    assert (run / "pipeline_timeline.png").stat().st_size > 10_000
    summary = json.loads((run / "summary.json").read_text())
    assert summary["pipeline bubble (%)"] == pytest.approx(100 * timeline["bubble"], abs=0.051)


def test_pipeline_checkpoint_resumes_and_evaluates_under_other_layouts(
    tmp_path, tiny_shapes, one_process
):
    """Stopped at step 2 under pp=2 (gpipe), resumed in one process; a one-process checkpoint
    resumed under pp=2; tools/eval.py scores that pp=2 run's checkpoint (under pp=2, its config) as
    the one process did."""
    saved = tmp_path / "saved"
    train_ok(
        *train_args(
            tiny_shapes,
            saved,
            *COMMON,
            "parallel=pp2",
            "parallel.schedule=gpipe",
            "trainer.stop_at_step=2",
            "parallel.timeline=false",
        )
    )
    assert read_trainer_state(latest_checkpoint(saved))["layout"] == {"dp": 1, "tp": 1, "pp": 2}
    assert not (saved / "pipeline_timeline.json").exists()  # not asked for (the default on CUDA)
    resumed = tmp_path / "resumed"
    train_ok(
        *train_args(
            tiny_shapes,
            resumed,
            *COMMON,
            *ONE_PROCESS,
            f"trainer.resume={latest_checkpoint(saved)}",
        )
    )
    ref, got = losses_of(one_process), losses_of(resumed)
    assert [got[s] for s in (3, 4)] == pytest.approx([ref[3], ref[4]], rel=1e-5)
    assert_same_weights(one_process, resumed)

    into_pp = tmp_path / "into_pp"
    step_2 = one_process / "checkpoints" / "step_2"
    train_ok(*train_args(tiny_shapes, into_pp, *COMMON, "parallel=pp2", f"trainer.resume={step_2}"))
    got = losses_of(into_pp)
    assert [got[s] for s in (3, 4)] == pytest.approx([ref[3], ref[4]], rel=1e-5)

    step = latest_checkpoint(into_pp).name.removeprefix("step_")
    out = train_ok(
        f"run_dir={into_pp}", f"step={step}", timeout=240, script=REPO / "tools" / "eval.py"
    )
    evaluated = json.loads(next((into_pp / "eval").glob("*/eval.json")).read_text())
    assert evaluated["val_loss"] == pytest.approx(evals_of(one_process, *EVALS)[4][0], rel=1e-5)
    assert f"val top-1: {evals_of(one_process, *EVALS)[4][1]:.2f}%" in out
