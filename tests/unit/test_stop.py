"""A stop signal's rules in one process: what counts as a second request, the launcher's wait, its
last line."""

import os
import signal
import time

import pytest
from helpers import REPO

from visiondist.utils.signals import StopNow, StopSignals


def test_one_ctrl_c_seen_twice_is_one_request_and_a_later_one_stops_at_once(monkeypatch):
    """A terminal's Ctrl-C reaches the rank and the launcher, which forwards it: both within a
    moment are one request (a checkpoint follows); a second Ctrl-C after that gives the checkpoint
    up."""
    stop = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the forwarded copy
        assert stop.received == "SIGINT" and stop.count == 1
        monkeypatch.setattr(StopSignals, "SAME_REQUEST_S", 0.0)
        time.sleep(0.01)
        with pytest.raises(StopNow, match="stopped by SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stop.restore()


def test_an_evaluation_stops_at_the_first_signal():
    stop = StopSignals().install(at_once=True)
    try:
        with pytest.raises(StopNow):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_the_launcher_waits_for_a_checkpoint_of_the_planned_size():
    from visiondist.config import compose
    from visiondist.launch.stop import AUTO_GRACE_S, grace_seconds
    from visiondist.plan import resolve

    def wait(*overrides):
        cfg = compose(REPO / "configs", list(overrides))
        return grace_seconds(cfg, resolve(cfg, {}, 0)[0])

    tiny, huge = (
        wait("model=vit_tiny"),
        wait("model=vit_huge", "parallel=tp4", "trainer.accelerator=cpu"),
    )
    assert AUTO_GRACE_S < tiny < AUTO_GRACE_S + 5  # 5.7M parameters: 1.8 s more
    # 632M parameters, AdamW: 7.6 GB of state on this node at 50 MB/s
    assert huge > AUTO_GRACE_S + 100
    assert wait("model=vit_huge", "trainer.stop_timeout_s=42") == 42
    # no memory model: the base
    assert wait("model=fasterrcnn_mobilenet_v3", "data=shapes_coco") == AUTO_GRACE_S


def _complete(path):
    """A checkpoint directory as a finished save leaves it (what `utils.dcp.is_complete` checks)."""
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    (path / "trainer_state.json").write_text("{}")


def test_the_last_line_says_what_the_run_dir_holds(tmp_path):
    from visiondist.launch.stop import stopped_line

    run = tmp_path / "run"
    assert "no complete checkpoint in" in stopped_line("SIGTERM", run, None, {"stopped at step": 7})
    _complete(run / "checkpoints" / "step_4")
    line = stopped_line("SIGTERM", run, None, {"stopped at step": 7})
    assert (
        line.startswith("stopped by SIGTERM: nothing was saved since step 4 ")
        and "continue from step 4" in line
    )
    _complete(run / "checkpoints" / "step_7")
    line = stopped_line("SIGINT", run, None, {"stopped at step": 7})
    assert line.startswith(
        "stopped by SIGINT after step 7 with a checkpoint; continue with: python "
    )
    assert line.endswith(f"trainer.run_dir={run}")
    # an evaluation's own directory: removed when it holds only its start-up files; anything else is
    # named, kept
    evaluation = tmp_path / "eval" / "2026-11-26_10-00-00"
    evaluation.mkdir(parents=True)
    for name in ("config.yaml", "eval.log", "layout.json"):
        (evaluation / name).write_text("")
    assert (
        stopped_line("SIGINT", evaluation, "eval")
        == (
            f"evaluation stopped by SIGINT: nothing evaluated; its "
            f"directory {evaluation} (config.yaml and the log only) "
            "was removed"
        )
        and not evaluation.exists()
    )
    assert (
        stopped_line("SIGINT", run, "eval")
        == (f"evaluation stopped by SIGINT: nothing evaluated; {run} holds checkpoints")
        and run.is_dir()
    )
    # ranks ended after writing their checkpoint (no result from them): metrics.csv's last step says
    # which it was
    (run / "metrics.csv").write_text("step,epoch,loss\n6,0,0.5\n7,0,0.4\n")
    line = stopped_line("SIGINT", run, None, why="a second stop signal ended the ranks at once")
    assert line.startswith("stopped by SIGINT after step 7 with a checkpoint; continue with: "), (
        line
    )
    (run / "metrics.csv").write_text("step,epoch,loss\n7,0,0.4\n8,0,0.3\n")
    line = stopped_line("SIGINT", run, None, why="a second stop signal ended the ranks at once")
    assert (
        "nothing was saved since step 7 (a second stop signal ended the ranks at once)" in line
    ), line


@pytest.mark.smoke
def test_this_torch_lets_the_launcher_keep_the_stop_signals():
    """Every supported release's elastic process context reads its signal list from the environment
    variable `compat.agent_signals` sets (torch 2.11 included: the smoke run)."""
    from visiondist.compat import agent_reads_signal_list

    assert agent_reads_signal_list()


def test_a_stopped_job_stops_its_sweep_with_its_line(tmp_path, capsys):
    """The second job of three is stopped: its line is printed, the sweep ends there with its exit
    code, and the sweep's record says stopped, not failed."""
    import json

    from visiondist.cli.sweep import run_sweep
    from visiondist.launch.stop import JobStopped

    ran = []

    def run(cfg):
        ran.append(cfg.trainer.seed)
        if len(ran) == 2:
            raise JobStopped(
                "SIGINT",
                f"stopped by SIGINT after step 3 with a checkpoint; continue with: python "
                f"tools/train.py trainer.run_dir={cfg.trainer.run_dir}",
            )
        return 0

    code = run_sweep(
        "train.py",
        REPO / "configs",
        ["trainer.seed=1,2,3", f"trainer.run_dir={tmp_path}"],
        run,
        None,
    )
    assert code == 130 and ran == [1, 2]
    assert (
        f"continue with: python tools/train.py trainer.run_dir={tmp_path / '1'}"
        in capsys.readouterr().err
    )
    statuses = [r["status"] for r in json.loads((tmp_path / "sweep.json").read_text())["jobs"]]
    assert statuses == ["done", "stopped (exit 130)"]


def test_the_hang_dump_signals_only_processes_that_catch_it():
    """A loader worker installs its SIGUSR1 stack dump in worker_init, after it starts: the watchdog
    signals only processes whose caught-signal mask has SIGUSR1 (a worker still starting would be
    ended, its rank failing with "DataLoader worker ... killed by signal" instead of the hang's
    stacks)."""
    from visiondist.faults.failures import catches_sigusr1

    before = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        assert not catches_sigusr1(os.getpid())
        signal.signal(signal.SIGUSR1, lambda *_: None)
        assert catches_sigusr1(os.getpid())
    finally:
        signal.signal(signal.SIGUSR1, before)


@pytest.mark.parametrize(
    "phase,hinted",
    [
        ("training", True),
        ("saving a checkpoint", True),  # a rank killed while it wrote the next one
        ("evaluating", True),
        ("loading the weights", False),  # nothing trained yet in this attempt
    ],
)
def test_a_failed_runs_line_names_the_command_that_continues(tmp_path, phase, hinted):
    from visiondist.launch.failed import _continue_hint
    from visiondist.utils.dcp import METADATA, STATE_FILE

    step = tmp_path / "checkpoints" / "step_10"
    step.mkdir(parents=True)
    (step / METADATA).write_bytes(b"")
    (step / STATE_FILE).write_text("{}")
    hint = _continue_hint(tmp_path, f"rank 0 failed at step 20 ({phase}): ConnectionResetError")
    assert ("once fixed, continue from step 10 with: " in hint) == hinted, hint
    assert not hinted or f"trainer.run_dir={tmp_path}" in hint
