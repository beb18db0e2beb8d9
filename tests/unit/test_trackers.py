"""trainer.loggers: the W&B and MLflow trackers for real, offline (W&B's offline run files, MLflow's
file store in a temporary directory), read back with their own formats and client; the one line of a
missing extra."""

import json
import sys
from pathlib import Path

import pytest
from helpers import REPO, assert_png
from tracking import FOREIGN, metric_rows, offline_env, wandb_run

from visiondist.config import ConfigError
from visiondist.observe.metrics import METRIC_COLUMNS, MetricsLogger, read_metrics

CONFIGS = REPO / "configs"

# what a run logs: training rows, then an evaluation at step 2 (the same step as a training row)
ROWS = [
    (1, {"epoch": 0, "loss": 1.75, "lr": 0.001, "grad_norm": 2.5, "images_per_s": 120.0}),
    (2, {"epoch": 0, "loss": 1.5, "lr": 0.0005, "grad_norm": 2.25, "images_per_s": 130.0}),
    (2, {"epoch": 1, "val_loss": 1.625, "val_top1": 37.5, "val_top5": 100.0}),
    (3, {"epoch": 1, "loss": 1.25, "lr": 0.00025, "grad_norm": 1.5, "images_per_s": 125.5}),
]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for key in FOREIGN:
        monkeypatch.delenv(key, raising=False)
    for key, value in offline_env(tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    # the tracker sets it (and it goes after the test)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    return tmp_path


def _cfg(out: Path, *overrides: str):
    from visiondist.config import compose

    return compose(CONFIGS, [f"trainer.output_dir={out}", "model.depth=2", *overrides])


def _plot(path: Path) -> Path:
    from visiondist.observe.plots import plot_curves

    rows = [{"step": s, **m} for s, m in ROWS]
    return plot_curves(rows, path, "a run", (("val_top1", "top-1"),))


def _run(cfg, run_dir: Path, rows=ROWS, finish=True, continue_from=None, status="finished"):
    """What the trainer does with its MetricsLogger: start the trackers, log the rows, then
    (`finish`) the plots and the weights, and close."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("model:\n  depth: 2\n")
    metrics = MetricsLogger(
        run_dir, True, cfg.trainer.loggers, METRIC_COLUMNS, continue_from=continue_from
    )
    metrics.start_trackers(cfg)
    for step, values in rows:
        metrics.log(step, **values)
    if finish:
        weights = run_dir / "model.safetensors"
        weights.write_bytes(b"weights" * 100)
        metrics.log_files([_plot(run_dir / "curves.png")], weights, rows[-1][0])
    metrics.close(status)
    return metrics


def _csv_values(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in r.items() if v is not None} for r in read_metrics(run_dir / "metrics.csv")
    ]


def test_wandb_offline_run_holds_the_config_every_csv_row_the_plots_and_the_weights(offline):
    pytest.importorskip("wandb")
    out = offline / "outputs"
    run_dir = out / "2026-11-25" / "10-00-00"
    cfg = _cfg(out, "trainer.loggers=[csv,wandb]", "trainer.project=proj")
    metrics = _run(cfg, run_dir)
    assert not (run_dir / "tensorboard").exists()  # not asked for
    wb = wandb_run(run_dir)  # under the run dir: WANDB_DIR is not set
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert wb["ids"] == [ids["wandb"]["id"]] and wb["projects"] == ["proj"]
    assert wb["names"] == ["2026-11-25/10-00-00"]  # the run dir under trainer.output_dir
    assert wb["config"]["model"]["depth"] == 2 and wb["config"]["trainer"]["loggers"] == [
        "csv",
        "wandb",
    ]
    # every metrics.csv row, under its column names, at its step
    assert (
        metric_rows(wb["history"], METRIC_COLUMNS)
        == _csv_values(run_dir)
        == [{"step": s, **m} for s, m in ROWS]
    )
    assert metrics.rows == [{"step": s, **m} for s, m in ROWS]
    (png,) = wb["images"].values()
    assert list(wb["images"]) == ["plots/curves"]
    assert_png(png)  # the PNG itself, copied into the W&B run
    assert wb["artifacts"] == [(f"model-{wb['ids'][0]}", "model", ["model.safetensors"])]
    assert wb["exit_codes"] == [0]


def test_wandb_continued_run_reopens_the_same_run_and_a_failure_ends_it_failed(offline):
    pytest.importorskip("wandb")
    out = offline / "outputs"
    run_dir = out / "run"
    cfg = _cfg(out, "trainer.loggers=[wandb]")
    _run(cfg, run_dir, ROWS[:2], finish=False, status="stopped")  # stopped after step 2
    _run(cfg, run_dir, ROWS[2:], continue_from=2, status="failed")  # continued, then failed
    wb = wandb_run(run_dir)
    # one W&B run, written by two processes
    assert len(wb["dirs"]) == 2 and len(set(wb["ids"])) == 1
    assert wb["exit_codes"] == [0, 1]
    # csv is implied: written anyway
    assert metric_rows(wb["history"], METRIC_COLUMNS) == _csv_values(run_dir)


def test_mlflow_file_store_holds_params_metric_history_plots_and_weights(offline):
    MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient

    out = offline / "outputs"
    run_dir = out / "2026-11-25" / "10-00-00"
    cfg = _cfg(out, "trainer.loggers=[csv,tensorboard,mlflow]", "trainer.project=proj")
    _run(cfg, run_dir)
    assert list((run_dir / "tensorboard").iterdir())
    ids = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    # the default: <output_dir>/mlruns
    assert ids["tracking_uri"] == (out / "mlruns").resolve().as_uri()
    client = MlflowClient(tracking_uri=ids["tracking_uri"])
    run = client.get_run(ids["run_id"])
    assert run.info.run_name == "2026-11-25/10-00-00" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    params = run.data.params
    assert params["model.depth"] == "2" and params["trainer.project"] == "proj"
    assert params["trainer.loggers"] == "['csv', 'tensorboard', 'mlflow']"
    assert len(params) > 100  # the whole config, over more than one batch of the API
    for column in METRIC_COLUMNS[1:]:
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(run.info.run_id, column)
        )
        assert history == [(s, pytest.approx(m[column])) for s, m in ROWS if column in m], column
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"model.safetensors", "config.yaml", "plots"} <= artifacts
    assert [f.path for f in client.list_artifacts(run.info.run_id, "plots")] == ["plots/curves.png"]
    local = Path(
        client.download_artifacts(run.info.run_id, "plots/curves.png", str(offline / "dl"))
    )
    assert_png(local)
    assert (
        Path(
            client.download_artifacts(run.info.run_id, "model.safetensors", str(offline / "dl"))
        ).read_bytes()
        == (run_dir / "model.safetensors").read_bytes()
    )


def test_mlflow_continued_run_logs_into_the_same_run(offline, monkeypatch):
    MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient

    store = offline / "elsewhere" / "mlruns"
    # the tool's own variable wins over the default
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    out = offline / "outputs"
    run_dir = out / "run"
    _run(_cfg(out, "trainer.loggers=[mlflow]"), run_dir, ROWS[:2], finish=False, status="stopped")
    first = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=store.as_uri())
    assert client.get_run(first["run_id"]).info.status == "KILLED"
    # continued with a changed setting: params are set once per MLflow run, the new key's first
    # value stays
    _run(
        _cfg(out, "trainer.loggers=[mlflow]", "trainer.log_every=7"),
        run_dir,
        ROWS[2:],
        continue_from=2,
        status="failed",
    )
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == first
    run = client.get_run(first["run_id"])
    assert run.info.status == "FAILED" and run.data.params["trainer.log_every"] == "10"
    assert sorted(m.step for m in client.get_metric_history(first["run_id"], "loss")) == [1, 2, 3]
    assert not (out / "mlruns").exists()


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_extra_is_one_line_before_the_ranks_start(name, monkeypatch, tmp_path):
    from visiondist.cli import load_config
    from visiondist.observe.trackers import open_trackers

    # `import <name>` fails as if it were not installed
    monkeypatch.setitem(sys.modules, name, None)
    line = f'trainer.loggers has {name} but {name} is not installed: pip install -e ".[{name}]"'
    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS, [f"trainer.loggers=[csv,{name}]", f"trainer.output_dir={tmp_path}"])
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value)
    # printing the config needs no tracker
    load_config(CONFIGS, [f"trainer.loggers=[csv,{name}]"], inputs=None)
    # the ranks' own check says the same
    with pytest.raises(ConfigError, match=r"pip install -e \"\.\[" + name):
        open_trackers(_cfg(tmp_path, f"trainer.loggers=[{name}]"), tmp_path, [name])


def test_an_unknown_logger_names_the_choices():
    from visiondist.cli import load_config

    with pytest.raises(ConfigError) as caught:
        load_config(CONFIGS, ["trainer.loggers=[csv,comet]"], inputs=None)
    assert str(caught.value) == (
        "trainer.loggers has 'comet': use any of csv, tensorboard, wandb, mlflow, e.g. "
        "trainer.loggers=[csv,tensorboard,wandb]"
    )


def test_a_failing_tracker_is_dropped_and_the_csv_goes_on(tmp_path, caplog):
    from visiondist.observe.trackers import Tracker, Trackers

    class Broken(Tracker):
        name = "broken"
        finished = None

        def log_metrics(self, row):
            raise ConnectionError("server gone\nmore")

        def finish(self, status):
            Broken.finished = status

    metrics = MetricsLogger(tmp_path, True, ["csv"], METRIC_COLUMNS)
    metrics.trackers = Trackers([Broken()])
    for step, values in ROWS:
        metrics.log(step, **values)
    metrics.close()
    assert len(read_metrics(tmp_path / "metrics.csv")) == len(ROWS)
    assert Broken.finished == "failed"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(
        "broken: logging metrics failed (ConnectionError: server gone); nothing more is sent"
    )


def test_a_run_from_before_loggers_continues_with_its_tensorboard_choice(tmp_path):
    from omegaconf import OmegaConf

    from visiondist.cli import load_config

    for tensorboard, loggers in ((True, ["csv", "tensorboard"]), (False, ["csv"])):
        run = tmp_path / str(tensorboard)
        run.mkdir()
        old = OmegaConf.to_container(_cfg(tmp_path, f"trainer.run_dir={run}"), resolve=True)
        del old["trainer"]["loggers"], old["trainer"]["project"]
        old["trainer"]["tensorboard"] = tensorboard  # as config.yaml was written then
        OmegaConf.save(OmegaConf.create(old), run / "config.yaml")
        cfg = load_config(CONFIGS, [f"trainer.run_dir={run}"], inputs=None)
        assert list(cfg.trainer.loggers) == loggers and cfg.trainer.project == "visiondist"
    with pytest.raises(
        ConfigError, match="trainer.tensorboard is not a setting any more: use trainer.loggers"
    ):
        load_config(CONFIGS, ["trainer.tensorboard=false"], inputs=None)


def test_tensorboard_keeps_a_continued_runs_steps_once(tmp_path):
    """A process lost after step 3 wrote steps 1-3; the run continues from its step-1 checkpoint
    and logs 2-3 again: TensorBoard reads each step once, the continuation's values, as
    metrics.csv keeps them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def logged(continue_from, rows):
        metrics = MetricsLogger(tmp_path, True, ["csv", "tensorboard"], METRIC_COLUMNS,
                                continue_from=continue_from)  # fmt: skip
        for step, loss in rows:
            metrics.log(step, loss=loss)
        metrics.close("finished")

    logged(None, [(1, 1.0), (2, 2.0), (3, 3.0)])
    logged(1, [(2, 20.0), (3, 30.0)])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 20.0),
        (3, 30.0),
    ]
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.csv")] == [
        (1, 1.0),
        (2, 20.0),
        (3, 30.0),
    ]
