"""Experiment trackers (`trainer.loggers`: wandb, mlflow): rank 0 sends each one what the run leaves
in its directory.

- the resolved config (W&B: the run's config; MLflow: its params, dotted keys, and config.yaml as an
  artifact);
- every row `MetricsLogger` writes to metrics.csv, under the CSV's column names, at its step (W&B:
  `step` is the x-axis of every metric, `define_metric`; MLflow: the metric's step);
- the PNG plots of the end-of-run report (W&B: images under `plots/<name>`; MLflow: artifacts under
  `plots/`);
- a complete run's model.safetensors (W&B: an Artifact `model-<run id>` of type model; MLflow: an
  artifact).

Each is an optional package (the extras `wandb`, `mlflow`), checked before the ranks start
(`visiondist.config.validate.check_trackers_installed`). Everything else is the tools' own
environment variables (WANDB_MODE, WANDB_API_KEY, WANDB_ENTITY, MLFLOW_TRACKING_URI, ...), with two
defaults of ours: W&B writes under the run dir (`<run>/wandb/`) unless WANDB_DIR is set, and MLflow,
without MLFLOW_TRACKING_URI, uses the local file store `<trainer.output_dir>/mlruns`.

The W&B run id and the MLflow run id are kept in `<run>/trackers.json`: a continued run
(`trainer.run_dir=<run>`) logs into the same tracker runs. A tracker that fails while the run goes
on is dropped with one warning: the run and its metrics.csv go on without it.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, cast

from omegaconf import DictConfig, OmegaConf

from visiondist.config.compose import flatten
from visiondist.config.validate import TRACKERS, check_trackers_installed

log = logging.getLogger(__name__)

# in the run dir: each tracker's run id, so that a continued run logs into the same run
RUN_IDS = "trackers.json"


class Tracker:
    """One tracker's run. `row`s are metrics.csv rows: {"step": N, column: value, ...}, values None
    or numbers."""

    name = ""

    def log_metrics(self, row: dict[str, Any]) -> None:
        raise NotImplementedError

    def log_images(self, paths: list[Path], step: int) -> None:
        raise NotImplementedError

    def log_weights(self, path: Path, step: int) -> None:
        raise NotImplementedError

    def finish(self, status: str) -> None:
        """End the run as `status`: finished (complete), stopped (to be continued) or failed."""
        raise NotImplementedError

    def ids(self) -> dict[str, Any]:
        """What `<run>/trackers.json` keeps of this run to reopen it."""
        raise NotImplementedError

    def describe(self) -> str:
        """Where this run is, for the log: `wandb: <url>`, `mlflow: run <id> in <store>`."""
        return self.name


class Trackers:
    """The trackers of one run (rank 0), each call sent to every one. A tracker that raises is
    dropped with a warning (a tracking server that goes away does not end a training run); finishing
    is attempted on every one."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def __bool__(self) -> bool:
        return bool(self.trackers)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def describe(self) -> str:
        return "; ".join(t.describe() for t in self.trackers)

    def _each(self, what: str, call) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:
                log.warning(
                    "%s: %s failed (%s: %s); nothing more is sent to %s in this run (metrics.csv "
                    "has everything)",
                    tracker.name,
                    what,
                    type(exc).__name__,
                    _first_line(exc),
                    tracker.name,
                )
                self.trackers.remove(tracker)
                _finish_quietly(tracker, "failed")

    def log_metrics(self, row: dict[str, Any]) -> None:
        self._each("logging metrics", lambda t: t.log_metrics(row))

    def log_images(self, paths: Iterable[Path], step: int) -> None:
        paths = [Path(p) for p in paths if p is not None and Path(p).is_file()]
        if paths:
            self._each("logging the plots", lambda t: t.log_images(paths, step))

    def log_weights(self, path: Optional[Path], step: int) -> None:
        if path is not None and Path(path).is_file():
            self._each("logging the weights", lambda t: t.log_weights(Path(path), step))

    def finish(self, status: str = "finished") -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            _finish_quietly(tracker, status)


def _finish_quietly(tracker: Tracker, status: str) -> None:
    try:
        tracker.finish(status)
    except Exception as exc:
        log.warning(
            "%s: closing the run failed (%s: %s)",
            tracker.name,
            type(exc).__name__,
            _first_line(exc),
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def open_trackers(cfg: DictConfig, run_dir: Path, loggers: Iterable[str]) -> Trackers:
    """Start (or, for a continued run, reopen) a run in each tracker of `loggers` (rank 0 only). A
    missing package raises the one-line `ConfigError` of the pre-launch check; a tracker that cannot
    start raises its own error."""
    names = [name for name in dict.fromkeys(loggers) if name in TRACKERS]
    if not names:
        return Trackers([])
    check_trackers_installed(names)
    run_dir = Path(run_dir)
    config = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    saved = read_ids(run_dir)
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(KINDS[name](cfg, run_dir, config, saved.get(name) or {}))
    except BaseException:
        Trackers(opened).finish("failed")
        raise
    write_ids(run_dir, {**saved, **{t.name: t.ids() for t in opened}})
    return Trackers(opened)


def read_ids(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / RUN_IDS
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        log.warning("%s cannot be read: the trackers start new runs", path)
        return {}


def write_ids(run_dir: Path, ids: dict[str, Any]) -> None:
    path = Path(run_dir) / RUN_IDS
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ids, indent=2) + "\n")
    tmp.replace(path)


def run_name(cfg: DictConfig, run_dir: Path) -> str:
    """The tracker run's name: the run dir relative to trainer.output_dir (`2026-11-25/15-27-44`, a
    sweep's `multirun/<date>/<time>/<job>`), or the run dir's own name when it lies elsewhere."""
    run_dir = Path(run_dir).resolve()
    try:
        return str(run_dir.relative_to(Path(cfg.trainer.output_dir).expanduser().resolve()))
    except ValueError:
        return run_dir.name


def _values(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.csv row's values (the step aside), without the empty ones."""
    return {k: float(v) for k, v in row.items() if k != "step" and v is not None}


# -- Weights & Biases ------------------------------------------------------------------------------


class WandbTracker(Tracker):
    """A W&B run: `wandb.init(project=trainer.project, name=<run name>, id=<kept id>,
    resume="allow")` writing under the run dir (WANDB_DIR otherwise). WANDB_MODE=offline keeps it on
    disk (`wandb sync <run>/wandb/offline-run-*` uploads it later)."""

    name = "wandb"

    def __init__(
        self, cfg: DictConfig, run_dir: Path, config: dict[str, Any], saved: dict[str, Any]
    ):
        import wandb  # noqa: PLC0415 (wandb: its extra)

        project = str(cfg.trainer.project)
        run_id = saved.get("id") if saved.get("project") == project else None
        kwargs: dict[str, Any] = {}
        if not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = str(run_dir)
        self.run = wandb.init(
            project=project,
            name=run_name(cfg, run_dir),
            id=run_id,
            resume="allow",
            config=config,
            allow_val_change=True,
            **kwargs,
        )
        self.run.define_metric("step")
        # every metric against the training step, as in the CSV
        self.run.define_metric("*", step_metric="step")
        self._wandb = wandb

    def ids(self) -> dict[str, Any]:
        return {"id": self.run.id, "project": self.run.project}

    def describe(self) -> str:
        if getattr(self.run, "offline", False) or not getattr(self.run, "url", None):
            return (
                f"wandb: run {self.run.id} offline in {Path(self.run.dir).parent} (wandb sync "
                "uploads it)"
            )
        return f"wandb: {self.run.url}"

    def log_metrics(self, row: dict[str, Any]) -> None:
        self.run.log({"step": int(row["step"]), **_values(row)})

    def log_images(self, paths: list[Path], step: int) -> None:
        self.run.log(
            {"step": int(step), **{f"plots/{p.stem}": self._wandb.Image(str(p)) for p in paths}}
        )

    def log_weights(self, path: Path, step: int) -> None:
        artifact = self._wandb.Artifact(
            f"model-{self.run.id}", type="model", metadata={"step": int(step)}
        )
        # no copy of the weights
        artifact.add_file(str(path), name=path.name, policy="immutable", skip_cache=True)
        self.run.log_artifact(artifact, aliases=["latest", f"step-{int(step)}"])

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=1 if status == "failed" else 0)


# -- MLflow ----------------------------------------------------------------------------------------

_MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


def mlflow_uri(cfg: DictConfig) -> str:
    """MLFLOW_TRACKING_URI when set (a server, a database, a directory), else the local file store
    `<trainer.output_dir>/mlruns`."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return (Path(cfg.trainer.output_dir).expanduser().resolve() / "mlruns").as_uri()


def _param_text(value: Any, limit: int = 500) -> str:
    """A config value as an MLflow param: its text, cut to what every tracking server takes (500
    characters; the whole config is the run's config.yaml artifact)."""
    text = "" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


def _file_store(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file:")


class MlflowTracker(Tracker):
    """An MLflow run in the experiment `trainer.project`, named after the run dir, through
    `MlflowClient` (no global active run). A file store gets MLFLOW_ALLOW_FILE_STORE=true unless
    that is set (MLflow 3 asks for it)."""

    name = "mlflow"

    def __init__(
        self, cfg: DictConfig, run_dir: Path, config: dict[str, Any], saved: dict[str, Any]
    ):
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 (mlflow: its extra)
        from mlflow.tracking import MlflowClient  # noqa: PLC0415 (mlflow: its extra)

        self.uri = mlflow_uri(cfg)
        if _file_store(self.uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = client = MlflowClient(tracking_uri=self.uri)
        project = str(cfg.trainer.project)
        run = None
        if saved.get("run_id") and saved.get("tracking_uri") == self.uri:
            try:
                run = client.get_run(saved["run_id"])
            except MlflowException:
                log.warning(
                    "mlflow: the run %s of %s is gone: starting a new one",
                    saved["run_id"],
                    self.uri,
                )
            if run is not None and run.info.lifecycle_stage != "active":
                run = None
        if run is None:
            experiment = client.get_experiment_by_name(project)
            if experiment is None:
                try:
                    experiment_id = client.create_experiment(project)
                except MlflowException:  # created meanwhile by another run
                    created = client.get_experiment_by_name(project)
                    if created is None:  # not that: the creation's own error
                        raise
                    experiment_id = created.experiment_id
            else:
                experiment_id = experiment.experiment_id
            tags = {"run_dir": str(run_dir), "mlflow.user": _user()}
            run = client.create_run(experiment_id, run_name=run_name(cfg, run_dir), tags=tags)
            known: dict[str, str] = {}
        else:
            client.update_run(run.info.run_id, status="RUNNING")
            known = run.data.params
        self.run_id = run.info.run_id
        self._log_params({k: v for k, v in flatten(config).items() if k not in known})
        config_file = Path(run_dir) / "config.yaml"
        if config_file.is_file():
            client.log_artifact(self.run_id, str(config_file))

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param  # noqa: PLC0415 (mlflow: its extra)

        items = [Param(key, _param_text(value)) for key, value in params.items()]
        # the tracking API takes at most 100 params per batch
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def ids(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.uri}

    def describe(self) -> str:
        return f"mlflow: run {self.run_id} in {self.uri}"

    def log_metrics(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric  # noqa: PLC0415 (mlflow: its extra)

        now, step = int(time.time() * 1000), int(row["step"])
        metrics = [Metric(key, value, now, step) for key, value in _values(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_images(self, paths: list[Path], step: int) -> None:
        for path in paths:
            self.client.log_artifact(self.run_id, str(path), "plots")

    def log_weights(self, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, _MLFLOW_STATUS[status])


# trainer.loggers name -> its tracker; the name is also a key of config.validate.TRACKERS (the
# module it imports)
# a tracker's class, as the run starts it: (cfg, run dir, the resolved config, its saved ids)
KINDS: dict[str, Callable[[DictConfig, Path, dict[str, Any], dict[str, Any]], Tracker]] = {
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}
