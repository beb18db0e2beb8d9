"""Fault injection on the CPU (gloo): what each fault costs the user. RELIABILITY.md tabulates the
outcomes.

Every multi-process test runs in its own process group with a hard timeout that kills the group
(`helpers.run_cli` / `helpers.spawn_ranks`)."""

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import fault_ranks
import pytest
import torch
from helpers import (
    REPO,
    TINY_DATA,
    TRAIN,
    RanksFailed,
    finish_job,
    job_env,
    losses_of,
    spawn_ranks,
    start_job,
    train_args,
    train_ok,
    wait_for,
)
from processes import children, rank_processes
from safetensors.torch import load_file

from visiondist.utils.dcp import CHECKPOINTS, list_checkpoints

# Timing-sensitive (kills, signals, hangs): one worker runs them in turn when the suite runs in
# parallel.
pytestmark = pytest.mark.xdist_group("faults")

# ~0.05 s per step on 2 cores: long enough to be interrupted mid-run
LONG = [
    "model.num_heads=2",
    "trainer.max_steps=100",
    "trainer.max_epochs=1000",
    "trainer.eval_every=1000",
    "parallel.dp=2",
    "trainer.log_every=1",
]


def _start(args: list[str]) -> subprocess.Popen:
    return start_job([sys.executable, str(TRAIN), *args])


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    out = finish_job(proc, timeout, "the job")
    return proc.returncode, out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_shapes):
    run = tmp_path_factory.mktemp("reliability") / "reference"
    train_ok(*train_args(tiny_shapes, run, *LONG))
    return run


# 1
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_ends_identical(
    tmp_path, tiny_shapes, uninterrupted
):
    run = tmp_path / "run"
    proc = _start(
        train_args(tiny_shapes, run, *LONG, "trainer.checkpoint_every=20", "trainer.max_restarts=1")
    )
    wait_for(
        lambda: len(list_checkpoints(run)) >= 1 and len(rank_processes(proc.pid)) == 2,
        proc,
        180,
        "a first checkpoint",
    )
    victim = random.choice(rank_processes(proc.pid))
    os.kill(victim, signal.SIGKILL)
    code, out = _finish(proc, 300)
    assert code == 0, out[-4000:]
    # the restart is said, naming the rank killed (its peer then failed on the lost connection)
    said = re.findall(
        r"rank [01] ended \(killed by SIGKILL\): every rank restarts from the newest checkpoint "
        r"\(restart 1 of trainer\.max_restarts=1\)",
        out,
    )
    assert len(said) == 1, out[-4000:]
    log = (run / "train.log").read_text()
    assert "resumed from" in log, log[-2000:]
    assert sorted(losses_of(run)) == list(range(1, 101))
    _same_weights(uninterrupted, run)  # bit for bit
    # failure/ holds what ended a run: the records of what the restart recovered from are set
    # aside once the run completes, each said in the log
    assert not list((run / "failure").glob("rank*.txt"))
    for record in (run / "failure" / "recovered").glob("rank*.txt"):
        assert f"recovered from: {record.read_text().splitlines()[0]}" in log


@pytest.mark.slow
def test_under_torchrun_a_killed_rank_restarts_in_the_same_run_dir(
    tmp_path, tiny_shapes, uninterrupted
):
    out = tmp_path / "out"
    args = [
        a
        for a in train_args(tiny_shapes, out, *LONG, "trainer.checkpoint_every=20")
        if "run_dir" not in a
    ]
    proc = start_job(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0",
            "--max-restarts=1",
            str(TRAIN),
            *args,
            f"trainer.output_dir={out}",
        ],
        job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
    )

    def first_checkpoint():
        return any(out.rglob("step_20/.metadata")) and len(children(proc.pid, b"train.py")) == 2

    wait_for(first_checkpoint, proc, 180, "a first checkpoint")
    os.kill(random.choice(children(proc.pid, b"train.py")), signal.SIGKILL)
    code, output = _finish(proc, 300)
    assert code == 0, output[-4000:]
    runs = [p.parent for p in out.rglob("config.yaml")]
    assert len(runs) == 1  # the restart continued the first attempt's run dir
    assert "resumed from" in (runs[0] / "train.log").read_text()
    _same_weights(uninterrupted, runs[0])


# 2
# --------------------------------------------------------------------------------------------------
def test_one_rank_raising_stops_the_whole_job_fast_with_its_traceback(tmp_path):
    start = time.time()
    with pytest.raises(RanksFailed) as failed:
        spawn_ranks(fault_ranks.raise_on_one_rank, 3, 1, str(tmp_path), timeout=120)
    elapsed = time.time() - start
    failures = failed.value.failures
    assert 1 in failures and "injected failure on rank 1" in failures[1]
    assert "Traceback" in failures[1] and "raise_on_one_rank" in failures[1]
    assert elapsed < 60, elapsed  # the others were waiting in a barrier: the launcher stopped them
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 3 and not any(_alive(pid) for pid in pids)  # no orphans


# 3
# --------------------------------------------------------------------------------------------------
def test_a_collective_one_rank_skips_fails_within_the_timeout(tmp_path):
    start = time.time()
    with pytest.raises(RanksFailed) as failed:
        spawn_ranks(fault_ranks.skip_a_collective, 2, 3.0, timeout=150)
    elapsed = time.time() - start
    assert 0 in failed.value.failures
    assert (
        "timed out" in failed.value.failures[0].lower()
        or "timeout" in failed.value.failures[0].lower()
    )
    assert elapsed < 3.0 + 45, elapsed  # start-up of 2 ranks + 3 s, not the 10-minute default


def test_the_trainer_shortens_the_collective_timeout_after_the_first_step(tmp_path, tiny_shapes):
    run = tmp_path / "run"
    train_ok(
        *train_args(
            tiny_shapes, run, "trainer.max_steps=2", "parallel.dp=2", "trainer.dist_timeout_s=7"
        )
    )
    assert "collective timeout now 7s" in (run / "train.log").read_text()


# 4
# --------------------------------------------------------------------------------------------------
def _nonfinite_overrides(data_root, run, policy):
    return [
        *TINY_DATA,
        f"data.root={data_root}",
        "data.batch_size=16",
        "trainer.max_steps=4",
        "trainer.log_every=1",
        "trainer.accelerator=cpu",
        "trainer.loggers=[csv]",
        f"trainer.run_dir={run}",
        f"trainer.on_nonfinite={policy}",
        "trainer.eval_every=1000",
        "model.num_heads=2",
        "parallel.dp=2",
    ]


def test_a_nan_on_one_rank_is_one_decision_skip(tmp_path, tiny_shapes):
    results = spawn_ranks(
        fault_ranks.nonfinite_on_one_rank,
        2,
        _nonfinite_overrides(tiny_shapes, tmp_path, "skip"),
        1,
        2,
        timeout=180,
    )
    a, b = results[0], results[1]
    for name in a["params"]:  # both ranks skipped the same step: the replicas are still identical
        assert torch.equal(a["params"][name], b["params"][name]), name
    assert a["summary"]["skipped steps (non-finite)"] == 1
    assert a["summary"]["steps"] == 4
    assert a["adam_steps"] == b["adam_steps"] == [3.0]  # 4 steps, 1 skipped
    assert "skipped the optimizer step" in (tmp_path / "train.log").read_text()


def test_a_nan_on_one_rank_is_one_decision_raise(tmp_path, tiny_shapes):
    with pytest.raises(RanksFailed) as failed:
        spawn_ranks(
            fault_ranks.nonfinite_on_one_rank,
            2,
            _nonfinite_overrides(tiny_shapes, tmp_path, "raise"),
            1,
            2,
            timeout=180,
        )
    # every rank takes the decision; the launcher reports the first to fail (and stops the other)
    reported = list(failed.value.failures.values())
    assert reported and all("non-finite loss at step 2 on rank 1:" in text for text in reported), (
        reported
    )
    assert "trainer.on_nonfinite=skip" in reported[0]


# 5
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "SIGINT to the process group"])
def test_a_stop_signal_checkpoints_every_rank_and_resume_continues(
    tmp_path, tiny_shapes, uninterrupted, how
):
    run = tmp_path / "run"
    args = train_args(tiny_shapes, run, *LONG)
    proc = _start(args)
    wait_for(
        lambda: len(losses_of(run)) >= 3 if (run / "metrics.csv").exists() else False,
        proc,
        180,
        "step 3",
    )
    sent = time.time()
    if how.startswith("SIGTERM"):
        os.kill(proc.pid, signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    code, out = _finish(proc, 90)
    # the prompt is back once the checkpoint is written (torch's agent alone: 32 s)
    assert time.time() - sent < 20
    assert code == (143 if how.startswith("SIGTERM") else 130), out[-3000:]
    ((step, path),) = list_checkpoints(run)[-1:]
    # a terminal's Ctrl-C
    assert f"after step {step} with a checkpoint; continue with: python " in out, out[-3000:]
    # reaches the launcher and every rank: one request, not a second one that would give the
    # checkpoint up
    assert 3 <= step < 100 and (path / ".metadata").is_file()
    assert f"stopped after step {step} of 100" in (run / "train.log").read_text()
    # the stop is the same for both signals; one resume check covers them
    if how.startswith("SIGINT"):
        return
    train_ok(*args)  # trainer.resume=auto (the default) in the same run dir
    assert f"resumed from {path}: step {step}" in (run / "train.log").read_text()
    _same_weights(uninterrupted, run)


# 6
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("saves", ["sync", "async"])
def test_kills_while_writing_checkpoints_never_leave_an_unloadable_newest(
    tmp_path, tiny_shapes, saves
):
    """A checkpoint every step (async: one always in flight while the next steps run); SIGKILL while
    one is being written (its `.step_<N>.tmp` directory is there), at a random point of the write,
    five times, each time resuming. After every kill the newest complete checkpoint loads in
    full."""
    from visiondist.checkpoint.export.trained import load_trained

    run = tmp_path / "run"
    args = train_args(
        tiny_shapes,
        run,
        "model.num_heads=2",
        "trainer.max_steps=1000",
        "trainer.max_epochs=1000",
        "trainer.checkpoint_every=1",
        "trainer.keep_last=2",
        "trainer.eval_every=10000",
        "trainer.log_every=1000",
        f"trainer.checkpoint_async={saves == 'async'}",
    )
    rng = random.Random()
    newest, during_a_write = 0, 0
    for kill in range(5):
        proc = _start(args)
        wait_for(
            lambda newest=newest: (
                list_checkpoints(run) and list_checkpoints(run)[-1][0] >= newest + 2
            ),
            proc,
            120,
            f"two new checkpoints (kill {kill})",
        )
        during_a_write += _kill_during_a_write(proc, run / CHECKPOINTS, rng)
        proc.communicate()
        found = list_checkpoints(run)
        assert found, f"kill {kill}: no checkpoint left"
        step, path = found[-1]
        trained = load_trained(run, step)  # every tensor of the newest is there
        assert trained.step == step and trained.source == path
        # anything else is an unfinished write or removal
        for entry in (run / CHECKPOINTS).iterdir():
            assert entry.name.startswith(".step_") or (entry / ".metadata").is_file(), entry
        assert step >= newest
        newest = step
    # most kills cut a write short (else the test tested little)
    assert during_a_write >= 3, during_a_write


def _kill_during_a_write(proc: subprocess.Popen, checkpoints: Path, rng: random.Random) -> bool:
    """SIGKILL the job's process group while a checkpoint is being written (a `.step_<N>.tmp`
    directory is there), up to 20 ms into it; after 2 s without one seen, wherever it is. Returns
    whether one was seen."""
    deadline = time.monotonic() + 2.0
    seen = False
    while not seen and time.monotonic() < deadline:
        try:
            seen = any(
                e.name.endswith(".tmp") and e.name.startswith(".step_")
                for e in checkpoints.iterdir()
            )
        except FileNotFoundError:
            pass
        time.sleep(rng.uniform(0.0, 0.02) if seen else 0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    return seen


# 7
# --------------------------------------------------------------------------------------------------
def test_hydra_targets_are_never_instantiated(tmp_path):
    from helpers import run_cli

    result = run_cli(["+model._target_=os.system", "trainer.max_steps=1"], timeout=60)
    assert result.returncode == 2 and "_target_" in result.stdout
    marker = tmp_path / "pwned"
    result = run_cli(
        [
            "model=fasterrcnn_mobilenet_v3",
            "data=shapes_coco",
            f"data.root={tmp_path}/d",
            "+model.kwargs._target_=os.system",
            f"+model.kwargs._args_=[touch {marker}]",
            "trainer.max_steps=1",
            "trainer.accelerator=cpu",
            f"trainer.run_dir={tmp_path}/r",
            "data.synthetic.train_images=4",
            "data.synthetic.val_images=2",
            "trainer.progress=false",
        ],
        timeout=120,
    )
    assert result.returncode != 0 and not marker.exists()


# 9
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [1, 2])
def test_ctrl_c_stops_a_benchmark_after_the_step_in_flight(tmp_path, tiny_shapes, ranks):
    """A benchmark used to note the signal and time every remaining step. Ctrl-C (SIGINT to the
    process group) ends it after the step in flight, on every rank, with 130 and one line; nothing
    is appended to the results."""
    results = tmp_path / "results"
    args = [
        *TINY_DATA,
        f"data.root={tiny_shapes}",
        "trainer.accelerator=cpu",
        "trainer.loggers=[csv]",
        f"trainer.output_dir={tmp_path / 'runs'}",
        f"parallel.dp={ranks}",
        "bench.warmup=1",
        "bench.steps=2000",
        "bench.rounds=2",
        f"bench.results_dir={results}",
        "bench.loader_batches=0",
    ]
    proc = start_job([sys.executable, str(REPO / "tools" / "benchmark.py"), *args])
    logs = tmp_path / "runs"
    wait_for(
        lambda: any("optimizer: adamw" in p.read_text() for p in logs.rglob("benchmark.log")),
        proc,
        180,
        "the benchmark's trainer",
    )
    time.sleep(5)  # timing the steps by now
    sent = time.time()
    os.killpg(proc.pid, signal.SIGINT)
    code, out = _finish(proc, 90)
    assert time.time() - sent < 60, out[-3000:]
    assert code == 130 and "benchmark stopped by SIGINT: nothing recorded" in out, out[-3000:]
    assert not (results / "results.jsonl").exists()
