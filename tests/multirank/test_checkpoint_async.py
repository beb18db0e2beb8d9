"""Asynchronous checkpoints and the best checkpoint through `python tools/train.py`: a run whose
checkpoints are written in the background trains, stops, resumes and ends exactly as one that writes
them synchronously; the best checkpoint by an evaluation metric is kept beside the last N and is
what `step=best` evaluates and exports."""

import json

import pytest
from helpers import REPO, assert_same_weights, losses_of, train_args, train_ok
from safetensors.torch import load_file

from visiondist.checkpoint.files import read_best, read_trainer_state
from visiondist.observe.metrics import read_metrics
from visiondist.utils.dcp import list_checkpoints

COMMON = [
    "model.num_heads=2",
    "parallel.dp=2",
    "model.drop_path_rate=0.2",
    "trainer.max_steps=10",
    "trainer.checkpoint_every=2",
    "trainer.eval_every=2",
    "trainer.keep_last=1",
    "trainer.best_metric=val_loss",
    # the highest val_loss: an early step, so the best is not also the newest
    "trainer.best_mode=max",
]


def test_async_checkpoints_resume_exactly_and_keep_the_best(tmp_path, tiny_shapes):
    """dp=2 with drop-path (the RNG states matter): 10 steps with synchronous saves vs asynchronous
    ones stopped at step 5 and resumed. Same losses and weights bit for bit; the stop waited for its
    save; both keep the newest checkpoint plus the best one (best.json agrees with metrics.csv;
    "best" is the highest val_loss here, an early step that keep_last=1 would otherwise have
    removed)."""
    sync, split = tmp_path / "sync", tmp_path / "async"
    train_ok(*train_args(tiny_shapes, sync, *COMMON))
    out = train_ok(
        *train_args(
            tiny_shapes, split, *COMMON, "trainer.checkpoint_async=true", "trainer.stop_at_step=5"
        )
    )
    assert "stopped after step 5 of 10" in out and "(written in the background)" in out
    # the stop's own save, complete
    assert read_trainer_state(list_checkpoints(split)[-1][1])["step"] == 5
    train_ok(*train_args(tiny_shapes, split, *COMMON, "trainer.checkpoint_async=true"))
    assert losses_of(split) == losses_of(sync)
    assert_same_weights(sync, split)

    evals = {
        int(r["step"]): r["val_loss"]
        for r in read_metrics(sync / "metrics.csv")
        if r["val_loss"] is not None
    }
    best_step = max(evals, key=lambda s: (evals[s], -s))
    assert best_step < 10
    for run in (sync, split):
        best = read_best(run)
        assert (best["metric"], best["mode"], best["step"]) == ("val_loss", "max", best_step)
        assert best["value"] == pytest.approx(evals[best_step], rel=1e-6)
        assert [s for s, _ in list_checkpoints(run)] == sorted({best_step, 10})

    # step=best picks it in tools/eval.py and tools/export.py
    train_ok(f"run_dir={split}", "step=best", script=REPO / "tools" / "eval.py")
    evaluated = json.loads(next((split / "eval").rglob("eval.json")).read_text())
    assert evaluated["val_loss"] == pytest.approx(evals[best_step], rel=1e-5)
    train_ok(
        f"run_dir={split}",
        "step=best",
        f"out={tmp_path / 'best.safetensors'}",
        script=REPO / "tools" / "export.py",
    )
    assert json.loads((tmp_path / "best.json").read_text())["source"]["step"] == best_step
    assert load_file(tmp_path / "best.safetensors")


def test_best_metric_must_be_an_evaluation_metric(tmp_path, tiny_shapes):
    from helpers import run_cli

    result = run_cli(
        train_args(tiny_shapes, tmp_path / "r", "trainer.best_metric=val_acc"), timeout=60
    )
    assert result.returncode == 2
    assert (
        "trainer.best_metric=val_acc is not an evaluation metric of classification: use one of "
        "val_loss, val_top1" in result.stdout
    )
    result = run_cli(
        train_args(tiny_shapes, tmp_path / "r", "trainer.best_metric=val_ema_top1"), timeout=60
    )
    assert (
        result.returncode == 2
        and "set trainer.ema_decay (e.g. 0.9998) or use val_top1" in result.stdout
    )
