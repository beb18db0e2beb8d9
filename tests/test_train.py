"""End to end through `python tools/train.py`: self-launched ranks, one run dir, dp=2 and dp=2 x tp=2 (+SP) equal to
dp=1."""

import json

import pytest
import yaml

from visiondist.engine.logging import read_metrics
from helpers import TINY_DATA, run_cli

STEPS = 6


def _train(tmp_path, tiny_shapes, name, *extra):
    out = tmp_path / name
    args = [*TINY_DATA, "model.num_heads=2", f"data.root={tiny_shapes}", "data.batch_size=16",
            f"trainer.max_steps={STEPS}",
            "trainer.log_every=1", "trainer.eval_every=3", "trainer.accelerator=cpu", f"trainer.output_dir={out}",
            *extra]
    result = run_cli(args, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    runs = [p.parent for p in out.rglob("config.yaml")]
    assert len(runs) == 1, runs  # one run dir for the whole job, not one per rank
    return runs[0], result.stdout


@pytest.fixture(scope="module")
def dp1_run(tmp_path_factory, tiny_shapes):
    return _train(tmp_path_factory.mktemp("ref"), tiny_shapes, "dp1")[0]


def _same_training(run1, run2):
    m1, m2 = read_metrics(run1 / "metrics.csv"), read_metrics(run2 / "metrics.csv")
    train1 = [r for r in m1 if r["loss"] is not None]
    train2 = [r for r in m2 if r["loss"] is not None]
    assert [r["step"] for r in train2] == list(range(1, STEPS + 1))
    for a, b in zip(train1, train2, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4, abs=1e-6), (a, b)
    assert len({r["loss"] for r in train1}) > 1  # it trained: the losses move
    eval1 = [r for r in m1 if r["val_top1"] is not None]
    eval2 = [r for r in m2 if r["val_top1"] is not None]
    assert [r["step"] for r in eval2] == [3, 6]
    for a, b in zip(eval1, eval2, strict=True):
        assert a["val_top1"] == b["val_top1"] and a["val_top5"] == b["val_top5"]
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)  # computed from the updated weights


def test_dp2_tp2_with_sequence_parallel_equals_dp1(tmp_path, tiny_shapes, dp1_run):
    run, stdout = _train(tmp_path, tiny_shapes, "dp2tp2", "parallel=dp2_tp2", "parallel.sequence_parallel=true")
    assert "dp=2 tp=2 pp=1 (4 ranks on cpu) +SP" in stdout
    _same_training(dp1_run, run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val images"] == 30 and summary["TP traffic per step (MB)"] > 0
    assert summary["parameters per rank (M)"] < summary["parameters (M)"]


def test_dp2_equals_dp1_and_writes_one_run_dir(tmp_path, tiny_shapes, dp1_run):
    run1 = dp1_run
    run2, stdout = _train(tmp_path, tiny_shapes, "dp2", "parallel.dp=2")
    assert "dp=2 tp=1 pp=1 (2 ranks on cpu)" in stdout

    cfg = yaml.safe_load((run2 / "config.yaml").read_text())
    assert cfg["parallel"]["dp"] == 2 and cfg["data"]["root"] == str(tiny_shapes)
    _same_training(run1, run2)
    s1, s2 = (json.loads((r / "summary.json").read_text()) for r in (run1, run2))
    assert s1["val images"] == s2["val images"] == 30  # every val sample counted once, under 1 and 2 ranks
    for run in (run1, run2):
        assert (run / "curves.png").stat().st_size > 0 and list((run / "tensorboard").iterdir())


def test_torchrun_joins_its_group_and_shares_one_run_dir(tmp_path, tiny_shapes):
    """Under torchrun the same script joins the job's group; rank 0 creates the run dir and tells the others."""
    out = tmp_path / "tr"
    torchrun = ("-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
                "--rdzv-endpoint=localhost:0", "--max-restarts=0")
    args = [*TINY_DATA, f"data.root={tiny_shapes}", "data.batch_size=16", "trainer.max_steps=2",
            "trainer.log_every=1", "trainer.accelerator=cpu", f"trainer.output_dir={out}"]
    result = run_cli(args, timeout=240, launcher=torchrun)
    assert result.returncode == 0, result.stdout[-4000:]
    runs = [p.parent for p in out.rglob("config.yaml")]
    assert len(runs) == 1
    assert "dp=2 tp=1 pp=1 (2 ranks on cpu)" in (runs[0] / "train.log").read_text()
    assert len([r for r in read_metrics(runs[0] / "metrics.csv") if r["loss"] is not None]) == 2
