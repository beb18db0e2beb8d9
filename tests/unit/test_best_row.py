"""The summary's best evaluation (visiondist.engine.summary): where no trainer.best_metric keeps
the best step's checkpoint and the run kept none of that step, a row says so with the setting that
keeps it; the best step stays a number (summary.json's readers index metrics.csv by it)."""

from types import SimpleNamespace

from omegaconf import OmegaConf

from visiondist.engine.summary import _best_evaluation


def _trainer(run_dir, best_metric=None, final=30):
    rows = [
        {"step": 10, "val_top1": 40.0},
        {"step": 20, "val_top1": 62.5},
        {"step": 30, "val_top1": 60.0},
    ]
    return SimpleNamespace(
        metrics=SimpleNamespace(rows=rows),
        parts=SimpleNamespace(task=SimpleNamespace(headline=("val_top1", "val top-1 (%)"))),
        cfg=OmegaConf.create({"trainer": {"best_metric": best_metric}}),
        run_dir=run_dir,
        state=SimpleNamespace(step=final),
    )


def _checkpoint(run_dir, step):
    path = run_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    (path / "trainer_state.json").write_text("{}")


def test_a_best_step_without_its_checkpoint_says_so_and_how_to_keep_it(tmp_path):
    _checkpoint(tmp_path, 30)
    assert _best_evaluation(_trainer(tmp_path)) == {
        "best val top-1 (%)": 62.5,
        "best at step": 20,
        "best's checkpoint": "not kept (trainer.best_metric=val_top1 keeps it)",
    }
    # kept by the cadence, asked for, or the run's last step: nothing more to say
    _checkpoint(tmp_path, 20)
    assert "best's checkpoint" not in _best_evaluation(_trainer(tmp_path))
    assert "best's checkpoint" not in _best_evaluation(_trainer(tmp_path / "x", "val_top1"))
    assert "best's checkpoint" not in _best_evaluation(_trainer(tmp_path / "y", final=20))
