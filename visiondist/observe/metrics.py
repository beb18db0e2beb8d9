"""metrics.csv (always: the summary and the plots read it) and the metrics' other destinations,
`trainer.loggers`: TensorBoard's scalars and the experiment trackers (`trackers.py`)."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from visiondist.observe.trackers import Trackers, open_trackers

# data_wait: the share of the window the step waited for its input; mfu: on a known GPU
TRAIN_COLUMNS = ("step", "epoch", "loss", "lr", "grad_norm", "images_per_s", "data_wait", "mfu")
METRIC_COLUMNS = (*TRAIN_COLUMNS, "val_loss", "val_top1", "val_top5")  # classification

log = logging.getLogger(__name__)


class MetricsLogger:
    """Appends rows to `metrics.csv` and sends them on to `trainer.loggers`: TensorBoard's scalars
    and the experiment trackers (`visiondist.observe.trackers`: W&B, MLflow), which also get the
    end-of-run plots and weights (`log_files`). A no-op on every rank but the main one. metrics.csv
    is always written: the summary and the plots read it."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        loggers: Sequence[str] = ("csv", "tensorboard"),
        columns: tuple[str, ...] = METRIC_COLUMNS,
        continue_from: Optional[int] = None,
    ):
        """`continue_from`: the step a run is resumed from in the same directory; the rows up to it
        are kept and the ones a lost process wrote after it are dropped. The trackers start with
        `start_trackers` (the training loop, which also closes them), not here."""
        self.enabled, self.columns, self.loggers = enabled, columns, tuple(loggers)
        self.run_dir = run_dir
        self.path = run_dir / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        self._tb = None
        self.trackers: Optional[Trackers] = None  # once started
        if not enabled:
            return
        if continue_from is not None and self.path.is_file():
            self.rows = [
                r
                for r in read_metrics(self.path)
                if (step := r.get("step")) is not None and step <= continue_from
            ]
        with self.path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            for row in self.rows:
                writer.writerow([_fmt(row.get(c)) for c in columns])
        if "tensorboard" in self.loggers:
            # 0.13 s after torch, in the launching process too (train.run imports this module)
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 (rank 0's alone)

            # continuing: the events a lost process wrote after `continue_from` are purged, as
            # metrics.csv's rows are (TensorBoard drops them when it reads the directory)
            self._tb = SummaryWriter(
                str(run_dir / "tensorboard"),
                purge_step=None if continue_from is None else continue_from + 1,
            )

    def start_trackers(self, cfg) -> None:
        """Start (or, continuing a run, reopen) the run of each tracker in `trainer.loggers` (rank
        0; once)."""
        if not self.enabled or self.trackers is not None:
            return

        self.trackers = open_trackers(cfg, self.run_dir, self.loggers)
        if self.trackers:
            log.info("tracking: %s", self.trackers.describe())

    def log(self, step: int, **metrics: Any) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: v for k, v in metrics.items() if k in self.columns}}
        self.rows.append(row)
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerow([_fmt(row.get(c)) for c in self.columns])
        if self._tb is not None:
            for key, value in row.items():
                if key not in ("step", "epoch") and value is not None:
                    self._tb.add_scalar(
                        ("val/" if key.startswith("val_") else "train/") + key, value, step
                    )
        if self.trackers:
            self.trackers.log_metrics(row)

    def log_files(self, images: Sequence[Path], weights: Optional[Path], step: int) -> None:
        """The end-of-run plots (PNGs) and the weights file, to the trackers."""
        if self.trackers:
            self.trackers.log_images(images, step)
            self.trackers.log_weights(weights, step)

    def close(self, status: str = "finished") -> None:
        """TensorBoard flushed; each tracker's run ended as `status`: finished (a complete run),
        stopped (to be continued) or failed."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.trackers is not None:
            self.trackers.finish(status)


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        # exact: the shortest text that reads back as the same float (integers without ".0")
        return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
    return str(value)


def read_metrics(path: Path) -> list[dict[str, Optional[float]]]:
    with Path(path).open() as f:
        return [
            {k: (float(v) if v != "" else None) for k, v in row.items()}
            for row in csv.DictReader(f)
        ]
