"""Every failure ends the job with one line naming the rank, the step and the cause, and leaves no
process behind.

These run the real CLI with the shipped loader settings (2 persistent workers per rank: the shapes
data's `data.num_workers`), because the workers are what used to keep a failed job alive. Faults are
injected by `tests/multirank/fault_train.py` (VISIONDIST_FAULT). Each test runs the job in its own
session under a hard timeout that kills the session, and asserts the exit code, the message, the
time to exit, that no process of the session survives, and which files are kept. The tests marked
`layouts` also run with the ranks on a GPU (tests/devices.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from devices import on_test_device
from helpers import REPO, TINY_DATA, TRAIN, finish_job, job_env, losses_of, start_job

from visiondist.checkpoint.files import latest_checkpoint
from visiondist.utils.dcp import list_checkpoints

pytestmark = pytest.mark.xdist_group("faults")

FAULT_TRAIN = REPO / "tests" / "multirank" / "fault_train.py"
# the shipped data.num_workers=2
WORKERS_ON = [a for a in TINY_DATA if not a.startswith("data.num_workers")]


def args(data: Path, run: Path, *extra: str) -> list[str]:
    return on_test_device(
        [
            *WORKERS_ON,
            f"data.root={data}",
            "data.batch_size=16",
            "trainer.accelerator=cpu",
            "trainer.log_every=1",
            "trainer.loggers=[csv]",
            f"trainer.run_dir={run}",
            "trainer.max_steps=6",
            *extra,
        ]
    )


def run_job(
    argv: list[str], fault: str = "", timeout: float = 150, script: Path = FAULT_TRAIN, **env: str
):
    """(exit code, output, seconds to exit). Fails if any process of the job's session is alive a
    second later."""
    start = time.monotonic()
    proc = start_job([sys.executable, str(script), *argv], job_env(VISIONDIST_FAULT=fault, **env))
    out = finish_job(proc, timeout, f"{script.name} {fault or '(no fault)'}")
    seconds = time.monotonic() - start
    # RELIABILITY.md
    print(
        f"{script.name} {fault or '(no fault)'}: exit code {proc.returncode} after {seconds:.1f} s"
    )
    time.sleep(1.0)
    survivors = _session(proc.pid)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"processes outlived the job: {survivors}\n{out[-3000:]}"
    return proc.returncode, out, seconds


def _session(sid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def error_line(out: str) -> str:
    """The job's last word: exactly one `error:` line, and no traceback anywhere."""
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    return lines[0]


@pytest.mark.parametrize("dp", [1, pytest.param(2, marks=pytest.mark.smoke)])
def test_a_nan_ends_the_job_with_one_line(tmp_path, tiny_shapes, dp):
    """RELIABILITY.md's promise for `optim.lr=1e9`: non-finite at step 2, the job ends (it used to
    hang in the loader workers' exit), leaving nothing in its temp dir (each rank's traceback
    pickle and the agent's error files stayed there)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    code, out, seconds = run_job(
        args(
            tiny_shapes,
            tmp_path / "run",
            "optim.lr=1e9",
            f"parallel.dp={dp}",
            "trainer.max_steps=30",
        ),
        script=TRAIN,
        TMPDIR=str(temp),
    )
    left = sorted(
        p.name
        for p in temp.iterdir()
        if not p.name.startswith(("visiondist-jobs-", "torchinductor"))
    )
    assert left == [], left
    line = error_line(out)
    assert code == 1 and seconds < 60, (code, seconds)
    assert "failed at step 2 (training)" in line and "non-finite loss at step 2 on rank" in line, (
        line
    )
    # the clipping is on (1.0, the default): the fix named is to lower it, not to set it
    assert "lower optim.lr, lower trainer.clip_grad (now 1), or trainer.on_nonfinite=skip" in line
    assert (tmp_path / "run" / "failure" / "rank0.txt").is_file()
    assert (
        "ERROR rank 0 failed at step 2 (training): NonFiniteStep"
        in (tmp_path / "run" / "train.log").read_text()
    )


@pytest.mark.layouts
def test_a_killed_rank_ends_the_job_within_a_minute_naming_it(tmp_path, tiny_shapes):
    """Rank 1 of a dp2 run SIGKILLed at step 4 (the OOM killer's way: no report, no checkpoint): the
    job ends with exit code 1 within 60 s of the kill, its one line names rank 1 and the signal
    (gloo's rank 0 fails at once on the closed connection and records that; NCCL's waits until the
    launcher ends it), and nothing is left running."""
    mark = tmp_path / "killed"
    code, out, _ = run_job(
        args(tiny_shapes, tmp_path / "run", "parallel.dp=2", "trainer.max_steps=30"),
        "rank_kill:4",
        VISIONDIST_SLOW_MARK=str(mark),
    )
    ended = time.time()
    line = error_line(out)
    (killed,) = tmp_path.glob("killed.*")
    assert code == 1 and ended - killed.stat().st_mtime < 60, (code, ended - killed.stat().st_mtime)
    assert line.startswith("error: rank 1 ended (killed by SIGKILL) without a report"), line


@pytest.mark.parametrize(
    "fault,dp", [("getitem_raise:0", 2), ("getitem_raise:40", 1)], ids=["first-batch", "mid-epoch"]
)
def test_a_dataset_raising_in_a_worker_ends_the_job(tmp_path, tiny_shapes, fault, dp):
    code, out, seconds = run_job(args(tiny_shapes, tmp_path / "run", f"parallel.dp={dp}"), fault)
    line = error_line(out)
    assert code == 1 and seconds < 60, (code, seconds)
    assert "ValueError: injected failure reading sample" in line and "data loader worker" in line, (
        line
    )
    step = int(line.split("failed at step ")[1].split()[0])
    assert (step == 1) if fault.endswith(":0") else (step > 1), line
    # every rank's workers raise: the rank that recorded first is the one the line names; the agent
    # may end the other before it records
    records = sorted((tmp_path / "run" / "failure").glob("rank*.txt"))
    assert records and all("getitem" in r.read_text() for r in records), records


def test_a_worker_killed_by_the_oom_killer_ends_the_job(tmp_path, tiny_shapes):
    code, out, seconds = run_job(args(tiny_shapes, tmp_path / "run"), "worker_kill:20")
    line = error_line(out)
    assert code == 1 and seconds < 60, (code, seconds)
    assert "DataLoader worker" in line and (
        "killed by signal" in line or "exited unexpectedly" in line
    ), line


def test_a_failure_during_evaluation_ends_the_job_after_saving(tmp_path, tiny_shapes):
    """A checkpoint due at an evaluation step is written first (`default_hooks`' order,
    train/hooks/default.py): the failing evaluation loses nothing of step 3."""
    run = tmp_path / "run"
    code, out, seconds = run_job(
        args(
            tiny_shapes, run, "parallel.dp=2", "trainer.eval_every=3", "trainer.checkpoint_every=3"
        ),
        "eval_raise",
    )
    line = error_line(out)
    assert code == 1 and seconds < 60, (code, seconds)
    assert (
        "failed at step 3 (evaluating): RuntimeError: injected failure during evaluation" in line
    ), line
    assert [step for step, _ in list_checkpoints(run)] == [3]


def test_a_failing_checkpoint_write_keeps_the_newest_complete_one(tmp_path, tiny_shapes):
    from visiondist.checkpoint.dcp import load_model_state
    from visiondist.checkpoint.export.trained import load_trained
    from visiondist.models import build_model

    run = tmp_path / "run"
    code, out, seconds = run_job(
        args(tiny_shapes, run, "parallel.dp=2", "trainer.checkpoint_every=2"), "save_fail:2"
    )
    line = error_line(out)
    assert code == 1 and seconds < 60, (code, seconds)
    assert "(saving a checkpoint): OSError" in line and "injected write error" in line, line
    assert [step for step, _ in list_checkpoints(run)] == [2]
    assert not (run / "checkpoints" / "step_4").exists()
    trained = load_trained(run, None)  # the newest complete checkpoint loads in full
    model = build_model(trained.cfg.model)
    load_model_state(latest_checkpoint(run), model, no_dist=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_eval_and_export_of_a_truncated_checkpoint_fail_in_one_line(tmp_path, tiny_shapes):
    run = tmp_path / "run"
    code, out, _ = run_job(args(tiny_shapes, run, "trainer.max_steps=2"), script=TRAIN)
    assert code == 0, out[-3000:]
    checkpoint = latest_checkpoint(run)
    for shard in checkpoint.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:4096])  # cut off in a copy
    code, out, seconds = run_job([f"run_dir={run}", "step=2"], script=REPO / "tools" / "eval.py")
    line = error_line(out)
    assert (
        code != 0
        and seconds < 60
        and str(checkpoint.name) in line
        and "(loading the weights)" in line
    ), line
    code, out, _ = run_job([f"run_dir={run}", "step=2"], script=REPO / "tools" / "export.py")
    line = error_line(out)
    assert code != 0 and checkpoint.name in line, (code, line)


def test_a_rank_stuck_before_a_collective_is_diagnosed(tmp_path, tiny_shapes):
    """Rank 1 never reaches step 3's collectives: both ranks write their stacks, the job ends with
    the folder."""
    run = tmp_path / "run"
    code, out, seconds = run_job(
        args(tiny_shapes, run, "parallel.dp=2", "trainer.dist_timeout_s=5"), "rank_hang:3"
    )
    line = error_line(out)
    assert code != 0 and seconds < 5 + 60, (code, seconds)
    assert str(run / "hang") in line, line
    stacks = {p.name: p.read_text() for p in (run / "hang").glob("rank*.txt")}
    assert {"rank0.txt", "rank1.txt"} <= set(stacks), sorted(stacks)
    assert "train_step" in stacks["rank1.txt"] and "time.sleep" in stacks["rank1.txt"], stacks[
        "rank1.txt"
    ]


def test_a_worker_stuck_in_getitem_is_diagnosed(tmp_path, tiny_shapes):
    run = tmp_path / "run"
    code, out, seconds = run_job(
        args(tiny_shapes, run, "trainer.dist_timeout_s=5"), "getitem_hang:40"
    )
    line = error_line(out)
    assert code != 0 and seconds < 5 + 60, (code, seconds)
    assert (
        "no progress for" in line
        and "trainer.dist_timeout_s=5" in line
        and str(run / "hang") in line
    ), line
    assert "_next_data" in (run / "hang" / "rank0.txt").read_text()
    workers = [p.read_text() for p in (run / "hang").glob("rank0-worker*.txt")]
    assert any("time.sleep(10_000)" in text for text in workers), workers


# -- work is never lost ----------------------------------------------------------------------------


def test_the_printed_continue_command_resumes_the_run_as_it_was(tmp_path, tiny_shapes):
    """A run started with a non-default batch and length, stopped, continued with exactly the
    printed command: same batch, same step count, config.yaml untouched; the same command once more
    changes nothing."""
    run = tmp_path / "run"
    code, out, _ = run_job(
        args(
            tiny_shapes,
            run,
            "data.batch_size=8",
            "trainer.max_steps=12",
            "trainer.stop_at_step=4",
            "trainer.checkpoint_every=100",
        ),
        script=TRAIN,
    )
    assert code == 0, out[-3000:]
    line = out.split("continue with: ")[-1].splitlines()[0]  # one unwrapped line, the whole command
    assert out.count("continue with") == 1, out[-3000:]
    python, script, *command = shlex.split(line)
    assert (
        python == "python"
        and (REPO / script).resolve() == TRAIN
        and command == [f"trainer.run_dir={run}"]
    ), line
    config = (run / "config.yaml").read_bytes()

    code, out, _ = run_job(command, script=TRAIN)
    assert code == 0, out[-3000:]
    assert "resumed from" in out and "global batch 8 (8 per rank" in out and "| 12 steps" in out, (
        out[-3000:]
    )
    assert "LR schedule follows" not in out
    assert (run / "config.yaml").read_bytes() == config
    assert [
        json.loads(line)["changes"] for line in (run / "attempts.jsonl").read_text().splitlines()
    ] == [{}]
    assert sorted(losses_of(run)) == list(range(1, 13))
    # the summary is the whole run's: its train time adds this attempt's to the one the step-4
    # checkpoint counted
    summary = json.loads((run / "summary.json").read_text())
    earlier = json.loads((run / "checkpoints" / "step_4" / "trainer_state.json").read_text())[
        "train_seconds"
    ]
    attempt = re.fullmatch(r"steps 5-12: ([\d.]+) s, ([\d.]+) img/s", summary["this attempt"])
    assert attempt and earlier > 0, summary
    assert summary["train time (s)"] == pytest.approx(earlier + float(attempt[1]), abs=0.1)
    seconds = summary["train time (s)"]  # rounded to 0.1 s
    assert (
        12 * 8 / (seconds + 0.05)
        <= summary["throughput (img/s)"]
        <= 12 * 8 / max(seconds - 0.05, 1e-3)
    )

    kept = {
        name: (run / name).read_bytes()
        for name in ("summary.json", "metrics.csv", "model.safetensors")
    }
    code, out, _ = run_job(command, script=TRAIN)
    assert code == 0 and "is complete at step 12: nothing to do" in out, out[-3000:]
    assert kept == {name: (run / name).read_bytes() for name in kept}


def test_continuing_a_run_with_another_batch_is_refused_unless_allowed(tmp_path, tiny_shapes):
    run = tmp_path / "run"
    code, out, _ = run_job(args(tiny_shapes, run, "trainer.max_steps=2"), script=TRAIN)
    assert code == 0, out[-3000:]
    code, out, seconds = run_job(
        [f"trainer.run_dir={run}", "data.batch_size=8", "trainer.max_steps=4"], script=TRAIN
    )
    line = error_line(out)
    assert code == 2 and seconds < 30, (code, out[-2000:])
    assert (
        "data.batch_size=16" in line
        and "data.batch_size=8" in line
        and "trainer.allow_changes=true" in line
    ), line
    code, out, _ = run_job(
        [
            f"trainer.run_dir={run}",
            "data.batch_size=8",
            "trainer.max_steps=4",
            "trainer.allow_changes=true",
        ],
        script=TRAIN,
    )
    assert code == 0 and "global batch 8" in out, out[-3000:]


def test_the_end_of_run_evaluation_failing_keeps_weights_and_checkpoint(tmp_path, tiny_shapes):
    run = tmp_path / "run"
    code, out, _ = run_job(args(tiny_shapes, run, "trainer.max_steps=2"), "eval_raise")
    line = error_line(out)
    assert code == 1 and "failed at step 2 (evaluating)" in line, line
    assert (run / "model.safetensors").is_file() and [s for s, _ in list_checkpoints(run)] == [2]


def test_unreadable_val_images_are_refused_before_launch(tmp_path, tiny_shapes):
    """Every unreadable val image named with its reason, exit 2, no run dir (no rank started).
    (eval.py's check, and a COCO set's: tests/unit/test_bad_input.py)"""
    data = tmp_path / "data"
    shutil.copytree(tiny_shapes, data)
    bad = sorted((data / "val").rglob("*.jpg"))[3:5]
    bad[0].write_bytes(b"")
    bad[1].write_bytes(b"<html>not found</html>")
    run = tmp_path / "run"
    code, out, seconds = run_job(args(data, run), script=TRAIN)
    line = error_line(out)
    assert code == 2 and seconds < 60, (code, seconds, out[-2000:])
    assert line.startswith(
        f"error: 2 of 30 val images cannot be read: {bad[0]}: the file is empty; {bad[1]}: "
        "not an image ("
    ), line
    assert line.endswith("fix or remove them (every val image is scored)"), line
    assert not run.exists()


def test_each_unreadable_training_image_is_warned_once_and_counted(tmp_path, tiny_shapes):
    """Two persistent workers over four epochs meet each bad file several times: one warning for
    each file in the run, on the console and in train.log, bad_images.txt names both with their
    reasons, and the summary counts them; model.safetensors is written with the same file mode as
    every other output."""
    data = tmp_path / "data"
    shutil.copytree(tiny_shapes, data)
    bad = sorted((data / "train").rglob("*.jpg"))[::40][:2]
    for path in bad:
        path.write_bytes(b"not an image")
    run = tmp_path / "run"
    code, out, _ = run_job(args(data, run, "trainer.max_steps=24"), script=TRAIN)
    assert code == 0, out[-3000:]
    log = (run / "train.log").read_text()
    assert all(
        log.count(f"cannot read {path}") == 1 == out.count(f"cannot read {path}") for path in bad
    ), out[-3000:]
    listed = dict(line.split("\t") for line in (run / "bad_images.txt").read_text().splitlines())
    assert sorted(listed) == sorted(map(str, bad)) and all(reason for reason in listed.values()), (
        listed
    )
    assert json.loads((run / "summary.json").read_text())["unreadable train images (replaced)"] == 2
    umask = os.umask(0)
    os.umask(umask)
    assert (run / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_an_image_folder_of_unreadable_files_ends_the_job(tmp_path):
    """The data's own clear error (every training image unreadable) used to be followed by a hang at
    exit."""
    from PIL import Image

    root = tmp_path / "junk"
    for split, count in (("train", 10), ("val", 2)):
        for name in ("a", "b"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                if split == "train":
                    (folder / f"{i}.jpg").write_bytes(b"junk")
                else:
                    Image.new("RGB", (32, 32), (i * 90, 0, 0)).save(folder / f"{i}.png")
    code, out, seconds = run_job(
        [
            "data=imagenet",
            f"data.root={root}",
            "data.num_classes=2",
            "data.batch_size=4",
            "data.img_size=32",
            "data.num_workers=2",
            "model.depth=2",
            "trainer.progress=false",
            "trainer.accelerator=cpu",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
        script=TRAIN,
    )
    line = error_line(out)
    assert code == 1 and seconds < 60, (code, seconds)
    assert "10 consecutive images" in line and "data.max_bad_images" in line, line


@pytest.mark.layouts
def test_a_cuda_out_of_memory_ends_the_job_in_one_line_with_the_plan(tmp_path, tiny_shapes):
    """Rank 1 of a dp2 run raises the CUDA allocator's out-of-memory error at step 3: the job's one
    line names rank 1 and the step, says what the allocator said in a clause (not its paragraph),
    the plan's figure for the layout and what would be planned at three quarters of it (for ViT-Ti
    at 32 px, whose state is most of it, nothing: the unit tests cover a layout with settings to
    name); the traceback stays in the rank's failure record."""
    code, out, seconds = run_job(
        args(
            tiny_shapes,
            tmp_path / "run",
            "parallel.dp=2",
            "parallel.device_memory_gb=80",
            "trainer.max_steps=30",
        ),
        "cuda_oom:3",
    )
    line = error_line(out)
    assert code == 1 and seconds < 60, (code, seconds)
    assert re.match(
        r"error: rank 1 failed at step 3 \(training\): CUDA out of memory \(tried to allocate "
        r"2\.00 GiB; 1\.06 GiB of 79\.19 GiB free\): the plan put dp=2 tp=1 pp=1 \(2 "
        r"(devices|GPUs) of 80 GB(, sharing GPU 0 over gloo)?\) at 0\.0\d+ GB a device "
        r"\(72 GB budget\); no accumulation or checkpointing plans it smaller: tools/plan.py "
        r"lists the layouts that fit \(traceback: ",
        line,
    ), line
    assert "expandable_segments" not in line
    assert "OutOfMemoryError" in (tmp_path / "run" / "failure" / "rank1.txt").read_text()
