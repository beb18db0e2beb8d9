"""The training loop in this process (one rank): accumulation is exact, bf16 autocast runs."""

import pytest
from helpers import REPO, TINY_DATA

from visiondist.cli import load_config
from visiondist.engine.run import train
from visiondist.launch import launch
from visiondist.observe.metrics import read_metrics


def _run(tmp_path, tiny_shapes, name, *extra):
    cfg = load_config(
        REPO / "configs",
        [
            *TINY_DATA,
            f"data.root={tiny_shapes}",
            "data.batch_size=16",
            "trainer.max_steps=4",
            "trainer.log_every=1",
            "trainer.accelerator=cpu",
            "trainer.loggers=[csv]",
            f"trainer.run_dir={tmp_path / name}",
            *extra,
        ],
    )
    launch(train, cfg, env={})
    rows = read_metrics(tmp_path / name / "metrics.csv")
    return [r for r in rows if r["loss"] is not None], [
        r for r in rows if r["val_top1"] is not None
    ]


def test_grad_accumulation_equals_one_big_batch(tmp_path, tiny_shapes):
    one, eval_one = _run(tmp_path, tiny_shapes, "ga1")
    four, eval_four = _run(tmp_path, tiny_shapes, "ga4", "trainer.grad_accum=4")
    for a, b in zip(one, four, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
    assert eval_one[-1]["val_loss"] == pytest.approx(eval_four[-1]["val_loss"], rel=1e-5)


def test_bf16_autocast_trains(tmp_path, tiny_shapes):
    ref, _ = _run(tmp_path, tiny_shapes, "fp32")
    bf16, evals = _run(tmp_path, tiny_shapes, "bf16", "trainer.precision=bf16")
    assert len(bf16) == 4 and evals[-1]["val_top1"] is not None
    for a, b in zip(ref, bf16):  # same run, lower precision: close, not equal
        assert a["loss"] == pytest.approx(b["loss"], rel=0.05)
    assert any(a["loss"] != b["loss"] for a, b in zip(ref, bf16))


def test_run_dir_is_never_reused(tmp_path, tiny_shapes):
    _run(tmp_path, tiny_shapes, "once")
    from visiondist.config import ConfigError

    with pytest.raises(ConfigError, match="already holds a run"):
        _run(tmp_path, tiny_shapes, "once", "trainer.resume=null")


def _try_to_change_the_config(cfg, layout, run_dir):
    from omegaconf.errors import ReadonlyConfigError

    try:
        cfg.trainer.max_steps = 5
        outcome = "changed"
    except ReadonlyConfigError:
        outcome = "read-only"
    (run_dir / "outcome.txt").write_text(f"{outcome} {layout.run.describe()}")


def test_ranks_get_the_resolved_layout_and_a_read_only_config(tmp_path, tiny_shapes):
    """Resolved once in the launching process: a rank reads its layout from the RunLayout it was
    handed (written to layout.json) and cannot change the config."""
    cfg = load_config(
        REPO / "configs",
        [
            *TINY_DATA,
            f"data.root={tiny_shapes}",
            "trainer.accelerator=cpu",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    run = launch(_try_to_change_the_config, cfg, env={})
    assert (
        tmp_path / "run" / "outcome.txt"
    ).read_text() == "read-only dp=1 tp=1 pp=1 (1 rank on cpu)"
    from visiondist.config.layout import RunLayout

    # the default: DDP fits
    assert RunLayout.load(tmp_path / "run") == run and run.chosen_by == "parallel=auto"
    assert "fit each device under DDP" in run.reason
