"""What a run leaves for people: console log, metrics.csv, TensorBoard, the experiment trackers' runs (`trackers.py`),
a summary table (plots: `plots.py`)."""

from __future__ import annotations

import csv
import logging
import math
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

TRAIN_COLUMNS = ("step", "epoch", "loss", "lr", "grad_norm", "images_per_s")
METRIC_COLUMNS = (*TRAIN_COLUMNS, "val_loss", "val_top1", "val_top5")  # classification


log = logging.getLogger(__name__)

LOG_FILE = "train.log"  # the run dir's log: train.log, or eval.log / benchmark.log for those jobs (setup_logging)


class _Stdout(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is at the time, as rich's console does (a library's chatter that a caller
    silences with `contextlib.redirect_stdout` stays silenced)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


class _Plain(logging.Formatter):
    """A message per line; warnings and errors say so."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno < logging.WARNING else f"{record.levelname}: {text}"


def in_terminal() -> bool:
    """Whether rank 0's console is a terminal (rich's console, which the log lines and the progress bars share)."""
    from rich import get_console

    return get_console().is_terminal


def setup_logging(run_dir: Path, is_main: bool, log_file: str = "train.log") -> None:
    """Rank 0 logs INFO to the console (in a terminal through rich, so progress bars stay intact; otherwise plain
    lines) and to `log_file` in the run dir (train.log; eval.log, benchmark.log for those jobs)."""
    global LOG_FILE
    LOG_FILE = log_file
    from rich.logging import RichHandler

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    if not is_main:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else "?"
        logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        return
    if in_terminal():  # rich's columns; into a pipe or a file, plain lines that do not wrap at 80 columns
        console = RichHandler(show_path=False, show_time=False, markup=False, rich_tracebacks=False)
        console.setFormatter(logging.Formatter("%(message)s"))
    else:
        console = _Stdout()
        console.setFormatter(_Plain("%(message)s"))
    file = logging.FileHandler(run_dir / log_file)
    file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(console)
    root.addHandler(file)
    root.setLevel(logging.INFO)


class MetricsLogger:
    """Appends rows to `metrics.csv` and sends them on to `trainer.loggers`: TensorBoard's scalars and the experiment
    trackers (`visiondist.engine.trackers`: W&B, MLflow), which also get the end-of-run plots and weights
    (`log_files`). A no-op on every rank but the main one. metrics.csv is always written: the summary and the plots
    read it."""

    def __init__(self, run_dir: Path, enabled: bool, loggers: Sequence[str] = ("csv", "tensorboard"),
                 columns: tuple[str, ...] = METRIC_COLUMNS, continue_from: Optional[int] = None):
        """`continue_from`: the step a run is resumed from in the same directory; the rows up to it are kept and the
        ones a lost process wrote after it are dropped. The trackers start with `start_trackers` (the training loop,
        which also closes them), not here."""
        self.enabled, self.columns, self.loggers = enabled, columns, tuple(loggers)
        self.run_dir = run_dir
        self.path = run_dir / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        self._tb = None
        self.trackers = None  # `trackers.Trackers` once started
        if not enabled:
            return
        if continue_from is not None and self.path.is_file():
            self.rows = [r for r in read_metrics(self.path) if r.get("step") is not None and r["step"] <= continue_from]
        with self.path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            for row in self.rows:
                writer.writerow([_fmt(row.get(c)) for c in columns])
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def start_trackers(self, cfg) -> None:
        """Start (or, continuing a run, reopen) the run of each tracker in `trainer.loggers` (rank 0; once)."""
        if not self.enabled or self.trackers is not None:
            return
        from visiondist.engine.trackers import open_trackers

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
                    self._tb.add_scalar(("val/" if key.startswith("val_") else "train/") + key, value, step)
        if self.trackers:
            self.trackers.log_metrics(row)

    def log_files(self, images: Sequence[Path], weights: Optional[Path], step: int) -> None:
        """The end-of-run plots (PNGs) and the weights file, to the trackers."""
        if self.trackers:
            self.trackers.log_images(images, step)
            self.trackers.log_weights(weights, step)

    def close(self, status: str = "finished") -> None:
        """TensorBoard flushed; each tracker's run ended as `status`: finished (a complete run), stopped (to be
        continued) or failed."""
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
        return [{k: (float(v) if v != "" else None) for k, v in row.items()} for row in csv.DictReader(f)]


def summary_table(summary: dict[str, Any]):
    """A two-column rich Table of the run's summary."""
    from rich.table import Table

    table = Table(title="training summary", show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # long paths wrap whole into a narrow (non-terminal) console, never cut
    for key, value in summary.items():
        if value is None:
            value = "-"
        elif isinstance(value, float):
            value = f"{value:.4g}" if math.isfinite(value) else str(value)
        table.add_row(key, str(value))
    return table
