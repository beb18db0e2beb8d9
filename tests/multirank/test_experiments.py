"""Named recipes (`experiment=`), multirun sweeps (`-m`) and run directories that never collide."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import REPO, TINY_DATA, losses_of, run_cli

CONFIGS = REPO / "configs"


def test_multirun_runs_each_job_with_its_own_ranks_into_its_own_run_dir(tmp_path, tiny_shapes):
    """`-m optim.lr=1e-3,3e-4 trainer.max_steps=3`: two complete runs (each on 2 self-launched
    ranks), numbered in one sweep directory, and a sweep.json of both."""
    out = tmp_path / "out"
    args = [
        "-m",
        "optim.lr=1e-3,3e-4",
        "trainer.max_steps=3",
        *TINY_DATA,
        f"data.root={tiny_shapes}",
        "data.batch_size=16",
        "trainer.log_every=1",
        "trainer.accelerator=cpu",
        "trainer.loggers=[csv]",
        "parallel.dp=2",
        f"trainer.output_dir={out}",
        "trainer.plots=true",
    ]
    result = run_cli(args, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    sweeps = list((out / "multirun").glob("*/*"))
    assert len(sweeps) == 1
    sweep = json.loads((sweeps[0] / "sweep.json").read_text())
    assert sweep["swept"] == ["optim.lr"] and [j["status"] for j in sweep["jobs"]] == [
        "done",
        "done",
    ]
    lrs = []
    for num, job in enumerate(sweep["jobs"]):
        run = sweeps[0] / str(num)
        assert job["run_dir"] == str(run)
        for name in (
            "config.yaml",
            "metrics.csv",
            "summary.json",
            "model.safetensors",
            "curves.png",
            "train.log",
        ):
            assert (run / name).is_file(), f"job {num} lacks {name}"
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["parallel"]["dp"] == 2 and cfg["trainer"]["run_dir"] == str(run)
        lrs.append(cfg["optim"]["lr"])
        assert sorted(losses_of(run)) == [1, 2, 3]
        assert (
            job["final train loss"]
            == json.loads((run / "summary.json").read_text())["final train loss"]
        )
    assert lrs == [1e-3, 3e-4]
    # the two learning rates trained differently
    assert losses_of(sweeps[0] / "0") != losses_of(sweeps[0] / "1")
    assert "sweep: 2 of 2 jobs" in result.stdout


def test_multirun_checks_every_job_before_the_first_starts(tmp_path):
    out = tmp_path / "out"
    result = run_cli(["-m", "optim.lr=1e-3,-1", f"trainer.output_dir={out}"], timeout=120)
    assert result.returncode == 2 and "job 1 (optim.lr=-1" in result.stdout, result.stdout
    assert not out.exists()  # nothing ran, nothing was written
    result = run_cli(["-m", "model=glob(vit_*)", f"trainer.output_dir={out}"], timeout=120)
    assert result.returncode == 2 and "error: -m:" in result.stdout, result.stdout


def test_multirun_is_refused_under_torchrun(monkeypatch):
    from visiondist.cli.sweep import run_sweep
    from visiondist.config import ConfigError

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="start one torchrun per job"):
        run_sweep("train.py", CONFIGS, ["optim.lr=1,2"], lambda cfg: 0)
