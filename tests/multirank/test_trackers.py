"""trainer.loggers=[csv,wandb,mlflow] through `python tools/train.py` on 2 ranks, stopped halfway
and continued: one W&B run (offline) and one MLflow run (file store) hold what the run dir holds,
written by rank 0 alone. In process, each backend on its own: tests/unit/test_trackers.py."""

import json
import sys

import pytest
from helpers import TINY_DATA, TRAIN, assert_png, finish_job, job_env, start_job
from tracking import FOREIGN, metric_rows, offline_env, wandb_run

from visiondist.observe.metrics import METRIC_COLUMNS, read_metrics

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def _train(args, env):
    proc = start_job([sys.executable, str(TRAIN), *args], env)
    out = finish_job(proc, 300, "train with trackers")
    assert proc.returncode == 0, out[-4000:]
    return out


def test_a_stopped_and_continued_run_logs_the_csv_plots_and_weights_to_wandb_and_mlflow(
    tmp_path, tiny_shapes, monkeypatch
):
    from mlflow.tracking import MlflowClient

    # reading the file store here (the run sets it itself)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    env = job_env(**offline_env(tmp_path / "home"))
    for key in (*FOREIGN, "MLFLOW_ALLOW_FILE_STORE"):  # the run sets the last itself
        env.pop(key, None)
    out, run = tmp_path / "outputs", tmp_path / "outputs" / "run"
    args = [
        *TINY_DATA,
        f"data.root={tiny_shapes}",
        "data.batch_size=16",
        "trainer.log_every=1",
        "trainer.accelerator=cpu",
        "parallel.dp=2",
        "trainer.max_steps=4",
        "trainer.eval_every=2",
        f"trainer.output_dir={out}",
        f"trainer.run_dir={run}",
        "trainer.loggers=[csv,wandb,mlflow]",
        "trainer.project=tiny",
        "trainer.plots=true",
    ]
    first = _train([*args, "trainer.stop_at_step=2"], env)
    ids = json.loads((run / "trackers.json").read_text())
    assert (
        f"tracking: wandb: run {ids['wandb']['id']} offline in {run / 'wandb'}/offline-run-"
        in first
        and f"; mlflow: run {ids['mlflow']['run_id']} in {(out / 'mlruns').as_uri()}" in first
    )
    # the default store: <output_dir>/mlruns
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    # stopped, to be continued
    assert client.get_run(ids["mlflow"]["run_id"]).info.status == "KILLED"
    _train([f"trainer.run_dir={run}"], env)  # continued: the run's own config
    assert json.loads((run / "trackers.json").read_text()) == ids  # the same tracker runs

    csv_rows = [
        {k: v for k, v in r.items() if v is not None} for r in read_metrics(run / "metrics.csv")
    ]
    assert [r["step"] for r in csv_rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in csv_rows if "val_top1" in r] == [2, 4]
    pngs = {"curves", "per_class_top1", "confusion"}

    wb = wandb_run(run)  # one process each time wrote it: rank 0
    assert (
        len(wb["dirs"]) == 2
        and set(wb["ids"]) == {ids["wandb"]["id"]}
        and set(wb["projects"]) == {"tiny"}
    )
    assert wb["names"] == ["run", "run"] and wb["exit_codes"] == [0, 0]
    assert wb["config"]["parallel"]["dp"] == 2 and wb["config"]["trainer"]["max_steps"] == 4
    assert metric_rows(wb["history"], METRIC_COLUMNS) == csv_rows
    assert set(wb["images"]) == {f"plots/{name}" for name in pngs}
    for png in wb["images"].values():
        assert_png(png)
    assert wb["artifacts"] == [(f"model-{ids['wandb']['id']}", "model", ["model.safetensors"])]

    run_id = ids["mlflow"]["run_id"]
    info = client.get_run(run_id)
    assert info.info.status == "FINISHED" and info.info.run_name == "run"
    assert client.get_experiment(info.info.experiment_id).name == "tiny"
    assert info.data.params["parallel.dp"] == "2" and info.data.params["trainer.max_steps"] == "4"
    for column in METRIC_COLUMNS[1:]:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, column))
        assert history == sorted((int(r["step"]), r[column]) for r in csv_rows if column in r), (
            column
        )
    assert {f.path for f in client.list_artifacts(run_id)} >= {
        "model.safetensors",
        "config.yaml",
        "plots",
    }
    assert {f.path for f in client.list_artifacts(run_id, "plots")} == {
        f"plots/{name}.png" for name in pngs
    }
    weights = client.download_artifacts(run_id, "model.safetensors", str(tmp_path / "dl"))
    assert open(weights, "rb").read() == (run / "model.safetensors").read_bytes()
