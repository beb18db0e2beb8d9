"""A training run from Python (`Run`) and the functions that make and use one: `train`,
`evaluate`, `export`, and `benchmark` (shells over `api.jobs`, as the tools are). A `Run` is its
directory: one returned by `train` and one opened later (`Run("outputs/2026-12-06/14-03-11")`)
read the same files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf

from visiondist.api.callbacks import pack
from visiondist.api.export_job import export_job
from visiondist.api.jobs import (
    CONFIGS,
    as_overrides,
    benchmark_job,
    evaluate_job,
    evaluation_config,
    refusals,
    train_job,
)
from visiondist.checkpoint.files import latest_checkpoint
from visiondist.cli.load import load_config
from visiondist.config import ConfigError
from visiondist.observe.console import said_to_python
from visiondist.observe.metrics import read_metrics
from visiondist.utils.dcp import step_of


class Run:
    """A training run's directory: what it was asked (`config`), how it ran (`layout`), what it
    measured (`metrics`, `rows`, `summary`), what it left (`weights`, `plots`, `checkpoints`), and
    what can be done with it (`evaluate`, `predict`, `export`, `resume`).

    Args:
        dir: the run dir (holds config.yaml).
        callbacks: each rank's callbacks as they ended the run, by rank (`train` fills it).
    """

    def __init__(self, dir: Union[str, Path], callbacks: Optional[dict[int, list]] = None):
        if not isinstance(dir, (str, Path)):
            raise ConfigError(f"Run({dir!r}): give a training run's dir (a path)")
        self.dir = Path(dir).expanduser().resolve()
        if not self.dir.is_dir():
            raise ConfigError(f"{dir}: no such folder: give a training run's dir")
        if not (self.dir / "config.yaml").is_file():
            raise ConfigError(f"{dir}: not a run dir (no config.yaml): give a training run's dir")
        self.callbacks = callbacks or {}

    def __repr__(self) -> str:
        rows = self.rows  # metrics.csv, read once for the step and the metrics
        state = "complete" if self.complete else f"stopped at step {_last_step(rows)}"
        shown = ", ".join(f"{k}={v:.4g}" for k, v in _latest_eval(rows).items() if k != "step")
        return f"Run('{self.dir}', {state}{', ' + shown if shown else ''})"

    @property
    def config(self) -> DictConfig:
        """The run's config as it was asked (config.yaml)."""
        return OmegaConf.load(self.dir / "config.yaml")  # type: ignore[return-value]

    @property
    def layout(self) -> dict[str, Any]:
        """The layout it resolved to (layout.json: dp, tp, pp, world size, accelerator, ...)."""
        path = self.dir / "layout.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def summary(self) -> dict[str, Any]:
        """The training summary of a complete run (summary.json; empty before it ends)."""
        path = self.dir / "summary.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @property
    def complete(self) -> bool:
        """The run reached its last step."""
        return bool(self.summary)

    @property
    def rows(self) -> list[dict[str, Any]]:
        """metrics.csv's rows, one per logged step: its loss, grad norm, LR, images/s and, where
        the step was evaluated, the evaluation's figures (the file writes those on a row of their
        own; here they join their step's)."""
        path = self.dir / "metrics.csv"
        rows: list[dict[str, Any]] = []
        for read in read_metrics(path) if path.is_file() else []:
            row: dict[str, Any] = dict(read)
            if row.get("step") is not None:  # a count, not a measurement
                row["step"] = int(row["step"])
            last = rows[-1] if rows else None
            if last is not None and last["step"] == row["step"] and _apart(last, row):
                last.update({k: v for k, v in row.items() if v is not None})
            else:
                rows.append(row)
        return rows

    @property
    def step(self) -> int:
        """The last step metrics.csv logged."""
        return _last_step(self.rows)

    @property
    def metrics(self) -> dict[str, Any]:
        """The latest evaluation's figures (`val_top1`, `val_map`, ...) with its "step"."""
        return _latest_eval(self.rows)

    @property
    def weights(self) -> Optional[Path]:
        """model.safetensors, which a complete run writes (timm's / torchvision's keys)."""
        path = self.dir / "model.safetensors"
        return path if path.is_file() else None

    @property
    def plots(self) -> list[Path]:
        """The PNGs the run drew (loss and accuracy curves, per-class figures)."""
        return sorted(self.dir.glob("*.png"))

    @property
    def checkpoints(self) -> list[Path]:
        """Its checkpoints, oldest first (checkpoints/step_<N>)."""
        found = (self.dir / "checkpoints").glob("step_*")
        return sorted(
            found, key=lambda p: int(p.name.split("_")[1]) if p.name[5:].isdigit() else -1
        )

    def evaluate(self, *overrides: str, step: Optional[Union[int, str]] = None, **settings: Any):
        """`visiondist.evaluate(run, ...)`: the metrics of its weights (or checkpoint `step`)."""
        return evaluate(self, *overrides, step=step, **settings)

    def predict(self, source: Any, **settings: Any) -> Any:
        """`visiondist.predict(source, run=run, ...)`: a result per image (with `save=`, the
        folder of tools/predict.py's files)."""
        from visiondist.api.predicting import predict  # noqa: PLC0415 (cv2, torchvision: 1 s)

        return predict(source, run=self, **settings)

    def export(self, format: str = "safetensors", **settings: Any) -> Path:
        """`visiondist.export(run, format, step=, out=, opset=, half=, int8=, ema=)`: the written
        file's path."""
        return export(self, format, **settings)

    def resume(self, *overrides: str, callbacks: Sequence[Any] = (), **settings: Any) -> Run:
        """Continue this run from its newest checkpoint in its own dir, with its own config and
        `overrides` on top (e.g. `trainer={"max_steps": 200}` to train longer), as its printed
        continue command does."""
        return train(
            *overrides,
            f"trainer.run_dir={self.dir}",
            "trainer.resume=auto",
            callbacks=callbacks,
            **settings,
        )


def train(*overrides: str, callbacks: Sequence[Any] = (), **settings: Any) -> Run:
    """Train, as `python tools/train.py` with the same overrides does: its own ranks
    (`trainer={"devices": 2}`, `parallel="tp2"`, ...) or this process alone, a run dir with the
    same files. Returns the `Run`, also when a stop (Ctrl-C, a kernel's interrupt, a callback's
    `state.stop()`) ended it early with a checkpoint (`run.complete` is then False).

        run = visiondist.train("model=vit_tiny", trainer={"max_steps": 10, "devices": 2})

    Args:
        *overrides: "group=option" / "group.key=value", as tools/train.py takes them.
        callbacks: objects with any of `on_train_start(state)`, `on_step_end(state)`,
            `on_eval_end(state)`, `on_train_end(state)`, run on every rank (docs/python.md).
        **settings: more overrides as nested keywords: `trainer={"max_steps": 10}`.

    Returns:
        The run; `run.callbacks` holds each rank's callbacks as it ended the run.

    Raises:
        ConfigError: a bad override, a layout that cannot run, a callback that cannot reach the
            ranks (one line, before any rank starts).
        RunFailed: a rank failed (its one line).
    """
    with refusals():
        cfg = load_config(CONFIGS, as_overrides(overrides, settings), inputs="train")
        packed = pack(callbacks)
    with said_to_python():  # what to run next: this Run's methods
        run_dir, returned = train_job(cfg, packed, stop_returns=True)
    if run_dir is None:  # a pod's node other than node 0: the job's run dir is node 0's choice
        raise RuntimeError(
            "this node's ranks trained without choosing the run dir (node 0 of the job did): "
            "open it with visiondist.Run(<run dir>)"
        )
    return Run(run_dir, callbacks=returned)


def evaluate(
    run: Optional[Union[Run, str, Path]] = None,
    *overrides: str,
    step: Optional[Union[int, str]] = None,
    weights: Optional[Union[str, Path]] = None,
    ema: bool = False,
    **settings: Any,
) -> dict[str, Any]:
    """Evaluate a run's weights (or `weights=` under the config `overrides` compose) on the val
    split, as tools/eval.py does: the same files into `<run>/eval/<date>_<time>/`.

    Args:
        run: a `Run` or a run dir (give this or `weights`; with `weights` the overrides may come
            first: `evaluate("model=vit_small", "data=imagenet", weights="vit.safetensors")`).
        *overrides: "group.key=value" (a run: e.g. "data.root=/data"), or for `weights` also
            "group=option" ("model=vit_small", "data=imagenet").
        step: the run's checkpoint: a step number or "best"; None: its model.safetensors, else its
            newest checkpoint.
        weights: a weights file, checkpoint or from_pretrained directory.
        ema: the checkpoint's EMA of the weights (tools/eval.py's ema=true): the model the run's
            `val_ema_*` figures scored.
        **settings: more overrides as nested keywords (`trainer={"devices": 2}`).

    Returns:
        The metrics (`val_top1`, `val_top5`, or `val_map`, `val_map50`, ...), with the training
        "step" of the weights where a run's checkpoint or model.safetensors says it (as
        `Run.metrics`).
    """
    if isinstance(run, str) and "=" in run and not Path(run).exists():  # evaluate("model=...", ...)
        overrides, run = (run, *overrides), None
    with refusals():
        where = run.dir if isinstance(run, Run) else run
        asked = as_overrides(overrides, settings) + (["model.weights_ema=true"] if ema else [])
        cfg, base = evaluation_config(where, step, weights, asked)
        metrics = evaluate_job(cfg, base)
    trained = _trained_step(Path(str(cfg.model.weights)), base)
    return {**metrics, **({"step": trained} if trained is not None else {})}


def _trained_step(weights: Path, run: Optional[Path]) -> Optional[int]:
    """The training step `weights` hold: a checkpoint's, or a run's model.safetensors's (its
    newest checkpoint's, which the end of the run writes with it); None where neither says."""
    if step_of(weights) is not None:
        return step_of(weights)
    if run is not None and weights == (run / "model.safetensors").resolve():
        newest = latest_checkpoint(run)
        return step_of(newest) if newest is not None else None
    return None


def export(
    run: Union[Run, str, Path],
    format: str = "safetensors",
    *,
    step: Optional[Union[int, str]] = None,
    out: Optional[Union[str, Path]] = None,
    opset: Optional[int] = None,
    half: bool = False,
    int8: bool = False,
    ema: bool = False,
) -> Path:
    """Export a run's weights, as tools/export.py does (the same files and check lines).

    Args:
        run: a `Run` or a run dir.
        format: safetensors (timm / torchvision keys), onnx, pt2, torchscript, hf, naflex,
            openvino (docs/checkpoints.md: which models each takes).
        step: its checkpoint (a step number or "best"); None: the newest, else model.safetensors.
        out: the file to write; None: `<run>/export/model.<ext>`.
        opset: format="onnx": the ONNX opset (17 to 20; None: 18).
        half: format="onnx": the network in float16, its val accuracy printed beside float32's.
        int8: format="onnx": convolutions and matrix products in int8 (calibrated on the run's
            train images), its val accuracy printed beside float32's.
        ema: the checkpoint's EMA of the weights (a run with trainer.ema_decay > 0), written as
            `<run>/export/model_ema.<ext>`; a step="best" by a `val_ema_*` metric reads it anyway.

    Returns:
        The written file (hf: directory).
    """
    with refusals():
        where = run.dir if isinstance(run, Run) else run
        return export_job(where, format, step, out, opset, half, int8, ema)


def benchmark(*overrides: str, **settings: Any) -> list[dict[str, Any]]:
    """Time the training step of a config beside plain PyTorch loops built from it, as
    `python tools/benchmark.py` with the same overrides does (the same table, results.jsonl and
    results.md in `<output dir>/benchmark/<date>_<time>/` or `bench.results_dir`).

        rows = visiondist.benchmark("model=vit_base", trainer={"precision": "bf16"},
                                    bench={"variants": ["trainer.compile=true"]})

    Args:
        *overrides: "group=option" / "group.key=value", as tools/benchmark.py takes them.
        **settings: more overrides as nested keywords (`bench={"steps": 20}`).

    Returns:
        One row per configuration: its images/s, step time, MFU and the plain loops' beside it.
    """
    with refusals():
        cfg = load_config(CONFIGS, as_overrides(overrides, settings), inputs="train")
        return benchmark_job(cfg)


def _apart(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two rows of one step hold different figures (a training row and its evaluation):
    no key set in both to different values."""
    return not any(a.get(k) is not None and v is not None and a[k] != v for k, v in b.items())


def _last_step(rows: list[dict[str, Any]]) -> int:
    """The last step metrics.csv's `rows` logged (0: none)."""
    return max((int(r["step"]) for r in rows if r.get("step") is not None), default=0)


def _latest_eval(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The latest evaluation's figures in metrics.csv's `rows`, with its "step"; {} before one."""
    for row in reversed(rows):
        found = {k: v for k, v in row.items() if k.startswith("val_") and v is not None}
        if found:
            return {**found, "step": int(row["step"] or 0)}
    return {}
