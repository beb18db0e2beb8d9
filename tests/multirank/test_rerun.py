"""Running the command that started a run again, as a user does after a crash and as a SLURM requeue
does: it continues the run, or says it is complete, although the run inferred values the command
leaves open (the class count from the class folders, the loader workers from the cores, the layout
under parallel=auto), and a recipe (`experiment=`) is part of the command."""

from __future__ import annotations

import sys

import pytest
from helpers import (
    REPO,
    fake_slurm,
    finish_job,
    job_env,
    losses_of,
    run_cli,
    run_together,
    start_job,
)

FAULT_TRAIN = REPO / "tests" / "multirank" / "fault_train.py"
STEPS = 6


def _command(root, run, *extra):
    """data=imagenet on the tiny shapes tree (classes inferred), workers and layout left to the
    run."""
    return [
        "data=imagenet",
        f"data.root={root}",
        "model=vit_tiny",
        "model.depth=2",
        "model.num_heads=2",
        "data.img_size=32",
        "data.batch_size=8",
        "data.eval_batch_size=8",
        "data.num_workers=-1",
        "parallel=auto",
        f"trainer.max_steps={STEPS}",
        "trainer.checkpoint_every=2",
        "trainer.eval_every=1000",
        "trainer.log_every=1",
        "trainer.accelerator=cpu",
        "trainer.loggers=[csv]",
        "trainer.progress=false",
        f"trainer.run_dir={run}",
        *extra,
    ]


def _crashed(command, fault="save_fail:2"):
    """The command under tests/multirank/fault_train.py: the second checkpoint write fails (step 4),
    the job ends."""
    proc = start_job([sys.executable, str(FAULT_TRAIN), *command], job_env(VISIONDIST_FAULT=fault))
    out = finish_job(proc, 240, "the crashing run")
    assert proc.returncode != 0 and "injected write error" in out, out[-3000:]
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_shapes):
    run = tmp_path_factory.mktemp("straight") / "run"
    result = run_cli(_command(tiny_shapes, run, "trainer.devices=2"))
    assert result.returncode == 0, result.stdout[-3000:]
    assert "data.num_classes=6: inferred from the 6 class folders" in result.stdout
    assert "parallel=auto chose plain DDP on 2 ranks" in result.stdout
    return run


@pytest.mark.parametrize(
    "recipe",
    [
        [],
        [
            "experiment=vit_b16_imagenet",
            "trainer.precision=32",
            "data.mixup=0",
            "data.cutmix=0",
            "data.auto_augment=none",
            "data.random_erasing=0",
        ],
    ],
    ids=["groups", "experiment"],
)
def test_the_same_command_continues_a_crashed_run_then_says_it_is_complete(
    tmp_path, tiny_shapes, straight, recipe
):
    """The command (2 self-launched ranks) crashes at step 4's checkpoint; the same command again
    continues from step 2 with the uninterrupted run's losses; once more, it says the run is
    complete and changes nothing."""
    run = tmp_path / "run"
    command = _command(tiny_shapes, run, "trainer.devices=2", *recipe)
    _crashed(command)
    result = run_cli(command)
    assert result.returncode == 0 and "resumed from" in result.stdout, result.stdout[-3000:]
    assert "was trained with" not in result.stdout
    if not recipe:  # the recipe's own settings (EMA, label smoothing, schedule) train other numbers
        assert [losses_of(run)[s] for s in range(3, STEPS + 1)] == pytest.approx(
            [losses_of(straight)[s] for s in range(3, STEPS + 1)], rel=1e-6
        )
    assert sorted(losses_of(run)) == list(range(1, STEPS + 1))
    kept = {
        name: (run / name).read_bytes()
        for name in ("summary.json", "metrics.csv", "model.safetensors")
    }
    result = run_cli(command)
    assert (
        result.returncode == 0
        and f"is complete at step {STEPS}: nothing to do (to train longer, give "
        f"trainer.max_steps above {STEPS})"
        in result.stdout
    ), result.stdout[-3000:]
    assert kept == {name: (run / name).read_bytes() for name in kept}
    # a shorter length than the run trained: nothing to do either, nothing rewritten
    shorter = [a for a in command if not a.startswith("trainer.max_steps=")]
    result = run_cli([*shorter, f"trainer.max_steps={STEPS - 2}"])
    assert result.returncode == 0 and f"is complete at step {STEPS}: nothing to do" in (
        result.stdout
    ), result.stdout[-3000:]
    assert kept == {name: (run / name).read_bytes() for name in kept}


def test_a_changed_command_is_still_refused(tmp_path, tiny_shapes, straight):
    """What the command asks is compared, not what the run inferred: another class count is a
    change."""
    result = run_cli(_command(tiny_shapes, straight, "trainer.devices=2", "data.num_classes=5"))
    assert result.returncode == 2
    assert (
        "was trained with data.num_classes=6, this command asks data.num_classes=5" in result.stdout
    )


def test_a_requeued_slurm_job_continues_its_run_then_says_it_is_complete(
    tmp_path, tiny_shapes, straight
):
    """tools/slurm_train.sh under a stand-in srun (2 nodes x 1 task): the first attempt crashes at
    step 4's checkpoint; the requeued job, the same script and arguments, continues with the
    uninterrupted run's losses; a third submission says the run is complete."""
    run = tmp_path / "slurm_run"
    args = [a for a in _command(tiny_shapes, run) if not a.startswith("trainer.run_dir")]

    def submit(**extra):
        env = {**fake_slurm(tmp_path / "bin", "4243", nodes=2, per_node=1, run_dir=run), **extra}
        (result,) = run_together(
            [["bash", str(REPO / "tools" / "slurm_train.sh"), *args]], timeout=300, envs=[env]
        )
        return result

    first = submit(SRUN_SCRIPT=str(FAULT_TRAIN), VISIONDIST_FAULT="save_fail:2")
    assert first.returncode != 0 and "injected write error" in first.stdout, first.stdout[-3000:]
    requeued = submit()
    assert requeued.returncode == 0 and "resumed from" in requeued.stdout, requeued.stdout[-3000:]
    assert [losses_of(run)[s] for s in range(3, STEPS + 1)] == pytest.approx(
        [losses_of(straight)[s] for s in range(3, STEPS + 1)], rel=1e-6
    )
    again = submit()
    assert (
        again.returncode == 0 and f"is complete at step {STEPS}: nothing to do" in again.stdout
    ), again.stdout[-3000:]


def test_slurm_script_requeues_itself_after_the_time_limits_stop(tmp_path):
    """tools/slurm_train.sh under a stand-in srun and scontrol: tasks that exit 143 (the ranks
    stopped on --signal's SIGTERM before the time limit, checkpoint written) requeue the job, which
    keeps its id and so its run dir; tasks that finish, fail otherwise, or run with
    VISIONDIST_REQUEUE=0 do not."""
    calls = tmp_path / "scontrol.calls"

    def submit(exit_code: int, **extra) -> tuple[int, list[str]]:
        env = fake_slurm(tmp_path / "bin", "4244", nodes=1, per_node=1, run_dir=tmp_path / "run")
        # scontrol: its calls noted (show hostnames answers the first host, as before)
        (tmp_path / "bin" / "scontrol").write_text(
            f'#!/bin/sh\necho "$@" >> {calls}\necho 127.0.0.1\n'
        )
        task = tmp_path / "task.py"
        task.write_text(f"import sys\nsys.exit({exit_code})\n")
        calls.write_text("")
        (result,) = run_together(
            [["bash", str(REPO / "tools" / "slurm_train.sh"), "model=vit_tiny"]],
            timeout=60,
            envs=[{**env, "SRUN_SCRIPT": str(task), **extra}],
        )
        return result.returncode, [c for c in calls.read_text().splitlines() if "requeue" in c]

    assert submit(143) == (143, ["requeue 4244"])
    assert submit(143, VISIONDIST_REQUEUE="0") == (143, [])
    assert submit(0) == (0, [])
    assert submit(1) == (1, [])
