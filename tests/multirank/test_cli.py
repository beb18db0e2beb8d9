"""The command line run as a user would: --help from a shell, a tiny training run put where
`hydra.run.dir` says with its next commands printed, and its evaluation by the old spelling. In
process: tests/unit/test_cli.py."""

import subprocess
import sys

import pytest
from helpers import REPO, TINY_DATA, run_cli, train_ok
from omegaconf import OmegaConf


def test_help_from_the_command_line():
    for name in ("eval", "export", "predict"):
        result = subprocess.run(
            [sys.executable, str(REPO / "tools" / f"{name}.py"), "--help"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0 and result.stdout.startswith(
            f"usage: python tools/{name}.py"
        ), result.stderr
        assert "run_dir=<dir>" in result.stdout


@pytest.fixture(scope="module")
def hydra_run(tmp_path_factory, tiny_shapes):
    """A 2-step tiny run placed by hydra.run.dir, and its output."""
    run = tmp_path_factory.mktemp("hydra") / "run"
    out = train_ok(
        *TINY_DATA,
        f"data.root={tiny_shapes}",
        "data.batch_size=16",
        "trainer.accelerator=cpu",
        "trainer.loggers=[csv]",
        "trainer.max_steps=2",
        f"hydra.run.dir={run}",
    )
    return run, out


def test_hydra_run_dir_puts_the_run_there_and_the_end_names_the_next_commands(hydra_run, tmp_path):
    """The start names the command that continues the run, and from where (the default checkpoints
    every 30 minutes); the end, the one that trains it on, which does: from its checkpoint at step 2
    to step 4, on its own config, and says the run is complete when given again."""
    import shlex
    import shutil

    from helpers import losses_of

    run, out = hydra_run
    assert (
        (run / "config.yaml").is_file()
        and (run / "model.safetensors").is_file()
        and (run / "train.log").is_file()
    )
    assert OmegaConf.load(run / "config.yaml").trainer.run_dir == str(run)
    assert (
        f"run dir {run}: if the job dies (a crash, a kill, a lost node), python tools/train.py "
        f"trainer.run_dir={run} continues it from its newest checkpoint (one every 30 minutes)"
    ) in out
    assert (
        f"run dir: {run}\n  train on: python tools/train.py trainer.run_dir={run} "
        "trainer.max_steps=4   (from its newest checkpoint, its config as it was)\n  evaluate: "
        f"python tools/eval.py run_dir={run}\n"
    ) in out
    assert f"python tools/export.py run_dir={run}" in out

    copy = tmp_path / "run"  # the module's other tests read the 2-step run
    shutil.copytree(run, copy)
    (line,) = [line for line in out.splitlines() if line.startswith("  train on: ")]
    argv = shlex.split(line.split(": ", 1)[1].split("   (")[0].replace(str(run), str(copy)))
    assert argv[:2] == ["python", "tools/train.py"]
    longer = train_ok(*argv[2:])
    assert f"resumed from {copy}/checkpoints/step_2: step 2" in longer and max(losses_of(copy)) == 4
    # its own continuing command keeps the length it trains to (config.yaml still says 2 steps)
    assert (
        f"python tools/train.py trainer.run_dir={copy} trainer.max_steps=4 continues it from its "
        "newest checkpoint" in longer
    )
    again = train_ok(*argv[2:])  # the same command once more: the run is complete at its new length
    assert f"{copy} is complete at step 4: nothing to do" in again, again[-2000:]

    # a job that died before its first checkpoint: the continuing command says it starts over; one
    # that checkpoints only at its end (checkpoint_every_min=0) is told so at its start
    died = tmp_path / "died"
    shutil.copytree(
        run, died, ignore=shutil.ignore_patterns("checkpoints", "summary.json", "model.safetensors")
    )
    over = train_ok(f"trainer.run_dir={died}", "trainer.checkpoint_every_min=0")
    assert (
        f"{died} holds no complete checkpoint (an earlier attempt ended before writing one; "
        "trainer.checkpoint_every=0, trainer.checkpoint_every_min=0): training starts again at "
        "step 1"
    ) in over, over[-3000:]
    assert (
        f"run dir {died}: a checkpoint is written when the run ends or is stopped (SIGTERM, "
        "Ctrl-C), not during it (trainer.checkpoint_every_min=0): python tools/train.py "
        f"trainer.run_dir={died} trainer.checkpoint_every_min=0 continues a stopped job; one that "
        "dies outright starts again at "
        "step 1 unless trainer.checkpoint_every_min=<minutes> or trainer.checkpoint_every=<steps> "
        "is set"
    ) in over, over[-3000:]


def test_eval_of_a_run_by_its_old_spelling_writes_an_eval_dir_and_says_where(hydra_run):
    run, _ = hydra_run
    result = run_cli(
        [str(run), "trainer.progress=false"], timeout=240, script=REPO / "tools" / "eval.py"
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.count("a bare path is deprecated") == 1
    assert (
        f"tools/eval.py {run}: a bare path is deprecated: write tools/eval.py run_dir={run}"
        in result.stdout
    )
    (out,) = (run / "eval").iterdir()
    # trainer.plots=false: no PNG
    assert f"eval dir: {out} (eval.json, per_class.json, eval.log)" in result.stdout
    assert {"eval.json", "per_class.json", "eval.log", "config.yaml"} <= {
        p.name for p in out.iterdir()
    }
    assert not (out / "train.log").exists()
