"""Stopping a job with SIGTERM or Ctrl-C keeps what it can and says what it kept
(`visiondist.launch.stop`).

torch's elastic agent gives ranks 30 s after a stop signal before it kills them; these tests make
one step (or an evaluation, an export) last longer than that with an injected sleep
(`fault_train.py`), with the shipped loader settings (2 workers), and signal the job the way a user
or a scheduler does."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    REPO,
    assert_same_weights,
    evals_of,
    finish_job,
    job_env,
    losses_of,
    start_job,
    train_args,
    train_ok,
    wait_for,
)
from processes import rank_processes

from visiondist.utils.dcp import list_checkpoints

# timed signals: one after another
pytestmark = [pytest.mark.xdist_group("faults"), pytest.mark.slow]

FAULT_TRAIN = Path(__file__).resolve().parent / "fault_train.py"
RUN = [
    "model.num_heads=2",
    "trainer.max_steps=10",
    "trainer.max_epochs=1000",
    "trainer.eval_every=1000",
    "parallel.dp=2",
]


def _shipped_workers(args: list[str]) -> list[str]:
    """The tests' tiny data turns loader workers off; a stop must work with the shipped
    data.num_workers=2."""
    return [a for a in args if not a.startswith("data.num_workers")]


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat")
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                return False
        except OSError:
            continue
    return True


def _last_line(out: str) -> str:
    return [line for line in out.splitlines() if line.strip()][-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_shapes):
    run = tmp_path_factory.mktemp("stop") / "reference"
    train_ok(*train_args(tiny_shapes, run, *RUN))
    return run


@pytest.mark.layouts
def test_sigterm_during_a_step_longer_than_the_agents_grace_keeps_the_run(
    tmp_path, tiny_shapes, reference
):
    """Step 4 takes 40 s more on every rank; SIGTERM to the launcher 1 s into it. Every rank
    finishes the step and writes a checkpoint (the agent alone killed them at 30 s, with nothing
    saved) instead of the evaluation due at that step, the prompt returns as soon as it is on disk,
    the last line is the one command that continues, and that command ends the run with the weights
    of the uninterrupted one."""
    run = tmp_path / "run"
    proc = start_job(
        [
            sys.executable,
            str(FAULT_TRAIN),
            *_shipped_workers(
                train_args(
                    tiny_shapes, run, *RUN, "trainer.eval_every=4", "trainer.best_metric=val_loss"
                )
            ),
        ],
        job_env(VISIONDIST_FAULT="slow_step:4", VISIONDIST_SLOW_S="40"),
    )
    wait_for(
        lambda: len(losses_of(run)) >= 3 if (run / "metrics.csv").exists() else False,
        proc,
        240,
        "step 3",
    )
    time.sleep(1.0)
    sent = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    out = finish_job(proc, 240, "the stopped job")
    waited = time.time() - sent
    assert proc.returncode == 143, out[-3000:]
    ((step, path),) = list_checkpoints(run)[-1:]
    # the evaluation due at step 4 is skipped:
    assert step == 4 and (path / ".metadata").is_file(), out[-3000:]
    # the signal came during the step, all ranks agree
    assert "eval  step 4" not in (run / "train.log").read_text()
    last = _last_line(out)
    assert last.startswith(
        f"stopped by SIGTERM after step {step} with a checkpoint; continue with: python "
    ), last
    # past the agent's grace; the step, the save, no extra wait
    assert 30 < waited < 39 + 30, (waited, out[-3000:])
    assert out.count("continue with") == 1 and "Traceback" not in out, out[-3000:]

    command = shlex.split(last.split("continue with: ", 1)[1])
    result = subprocess.run(
        [sys.executable, *command[1:]],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert f"resumed from {path}: step {step}" in (run / "train.log").read_text()
    assert sorted(losses_of(run)) == list(range(1, 11))
    assert_same_weights(reference, run)
    # the evaluation the stop skipped runs when the run continues, and the best checkpoint is chosen
    # among all three
    assert (
        "step 4's evaluation did not run before the run stopped" in (run / "train.log").read_text()
    )
    evaluated = evals_of(run, "val_loss")
    assert sorted(evaluated) == [4, 8, 10], evaluated
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best["value"] == min(v for (v,) in evaluated.values()) and best["step"] in evaluated


@pytest.mark.layouts
def test_a_launcher_killed_outright_leaves_no_rank_and_a_checkpoint(
    tmp_path, tiny_shapes, reference
):
    """SIGKILL to the launcher (the out-of-memory killer, a scheduler) 1 s into step 4: torch asks
    each rank to stop (SIGINT on its parent's death); every rank finishes the step, writes a
    checkpoint and ends, with its loader workers (torch's wrapper of a rank would otherwise wait
    for the dead launcher forever). Continuing the run ends it with the weights of the
    uninterrupted one."""
    from processes import children

    run = tmp_path / "run"
    proc = start_job(
        [sys.executable, str(FAULT_TRAIN), *_shipped_workers(train_args(tiny_shapes, run, *RUN))],
        job_env(VISIONDIST_FAULT="slow_step:4", VISIONDIST_SLOW_S="4"),
    )
    wait_for(
        lambda: len(losses_of(run)) >= 3 if (run / "metrics.csv").exists() else False,
        proc,
        240,
        "step 3",
    )
    ranks = rank_processes(proc.pid)
    workers = [w for rank in ranks for w in children(rank, b"")]
    assert len(ranks) == 2 and workers, (ranks, workers)
    time.sleep(1.0)
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.time() + 90
    while not _gone(ranks + workers) and time.time() < deadline:
        time.sleep(0.2)
    left = [pid for pid in ranks + workers if not _gone([pid])]
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"{len(left)} of the job's processes outlived its launcher by 90 s"
    ((step, path),) = list_checkpoints(run)[-1:]
    # the step in flight, or the next: a step's stop flag is read with the next step's health
    assert step in (4, 5) and (path / ".metadata").is_file(), (run / "train.log").read_text()
    assert f"stopped after step {step} of 10 (SIGINT)" in (run / "train.log").read_text()
    train_ok(*train_args(tiny_shapes, run, *RUN))
    assert sorted(losses_of(run)) == list(range(1, 11))
    assert_same_weights(reference, run)


def test_the_wait_for_a_stopping_step_is_bounded_and_the_loss_said(tmp_path, tiny_shapes):
    """trainer.stop_timeout_s=3 and a step of 60 s: the ranks are ended 3 s after SIGTERM, nothing
    is left running, and the last line says that nothing was saved since the step-2 checkpoint, with
    the command that continues from it (not a claim that a checkpoint was written)."""
    run = tmp_path / "run"
    args = _shipped_workers(
        train_args(tiny_shapes, run, *RUN, "trainer.checkpoint_every=2", "trainer.stop_timeout_s=3")
    )
    proc = start_job(
        [sys.executable, str(FAULT_TRAIN), *args],
        job_env(VISIONDIST_FAULT="slow_step:4", VISIONDIST_SLOW_S="60"),
    )
    wait_for(
        lambda: len(losses_of(run)) >= 3 if (run / "metrics.csv").exists() else False,
        proc,
        240,
        "step 3",
    )
    ranks = rank_processes(proc.pid)
    assert len(ranks) == 2
    sent = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    out = finish_job(proc, 120, "the stopped job")
    assert proc.returncode == 143 and time.time() - sent < 20, out[-3000:]
    assert [s for s, _ in list_checkpoints(run)] == [2]
    last = _last_line(out)
    assert last.startswith("stopped by SIGTERM: nothing was saved since step 2 "), last
    assert "trainer.stop_timeout_s" in last and "continue from step 2 with: python " in last, last
    assert "with a checkpoint" not in out
    wait_for(lambda: _gone(ranks), proc, 10, "the ranks ended")


@pytest.mark.parametrize(
    "ranks, how", [(1, "Ctrl-C"), (2, "Ctrl-C"), (2, "SIGTERM to the launcher")]
)
def test_a_stop_signal_ends_an_evaluation_at_once(tmp_path, reference, ranks, how):
    """An evaluation has nothing to save: a stop signal ends it at once, exit 128 + signal, one
    line, no eval.json, no traceback, no rank left (it used to score every image anyway, or end in a
    traceback on 2 ranks)."""
    mark = tmp_path / "slow"
    proc = start_job(
        [
            sys.executable,
            str(FAULT_TRAIN),
            f"run_dir={reference}",
            f"parallel.dp={ranks}",
            "trainer.progress=false",
        ],
        job_env(
            VISIONDIST_TOOL="eval",
            VISIONDIST_FAULT="slow_eval",
            VISIONDIST_SLOW_S="120",
            VISIONDIST_SLOW_MARK=str(mark),
        ),
    )
    wait_for(
        lambda: len(list(tmp_path.glob("slow.*"))) == ranks, proc, 240, "every rank evaluating"
    )
    spawned = rank_processes(proc.pid)
    sent = time.time()
    if how == "Ctrl-C":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    out = finish_job(proc, 60, "the stopped evaluation")
    name = "SIGINT" if how == "Ctrl-C" else "SIGTERM"
    assert proc.returncode == 128 + int(getattr(signal, name)) and time.time() - sent < 15, out[
        -3000:
    ]
    removed = re.fullmatch(
        rf"evaluation stopped by {name}: nothing evaluated; its directory (\S+) \(config.yaml "
        r"and the log only\) was removed",
        _last_line(out),
    )
    assert removed and "Traceback" not in out and "stopping with a checkpoint" not in out, out[
        -3000:
    ]
    # no half-made eval dir
    assert removed[1].startswith(str(reference / "eval")) and not Path(removed[1]).exists()
    wait_for(lambda: _gone(spawned), proc, 10, "the ranks ended")


def test_ctrl_c_ends_an_export_at_once(tmp_path, reference):
    mark = tmp_path / "slow"
    out_file = tmp_path / "model.safetensors"
    proc = start_job(
        [sys.executable, str(FAULT_TRAIN), f"run_dir={reference}", f"out={out_file}"],
        job_env(
            VISIONDIST_TOOL="export",
            VISIONDIST_FAULT="slow_export",
            VISIONDIST_SLOW_S="120",
            VISIONDIST_SLOW_MARK=str(mark),
        ),
    )
    wait_for(lambda: len(list(tmp_path.glob("slow.*"))) == 1, proc, 120, "the export running")
    sent = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    out = finish_job(proc, 60, "the stopped export")
    assert proc.returncode == 130 and time.time() - sent < 10, out[-3000:]
    assert (
        _last_line(out) == "export stopped by SIGINT: nothing written" and "Traceback" not in out
    ), out[-3000:]
    assert not out_file.exists()
