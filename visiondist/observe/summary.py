"""What rank 0 leaves at the end of a run: summary.json, the summary table (its paths below it,
whole), the PNG plots (`plots.py`), the task's final line and the commands that evaluate and export
the run."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Callable, Optional

from rich.console import Console
from rich.table import Table

from visiondist.observe.console import next_commands
from visiondist.observe.plots import plot_curves

log = logging.getLogger(__name__)


# rows whose value is a path: printed whole below the table, one per line (a table cell would break
# them mid-name); the run dir closes the run's output with the commands that use it
# (`next_commands`)
PATH_ROWS = ("checkpoint", "best checkpoint", "weights")
LAST_LINES = ("run dir",)


def summary_table(summary: dict[str, Any]):
    """A two-column rich Table of the run's summary, less its paths (`summary_paths`)."""
    table = Table(title="training summary", show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # text wraps at its spaces
    for key, value in summary.items():
        if key in PATH_ROWS or key in LAST_LINES:
            continue
        if value is None:
            value = "-"
        elif isinstance(value, float):
            value = f"{value:.4g}" if math.isfinite(value) else str(value)
        table.add_row(key, str(value))
    return table


def summary_paths(summary: dict[str, Any]) -> str:
    """The summary's paths, "key: path" a line, never wrapped by us (a terminal may fold them;
    copied, they are whole)."""
    return "\n".join(
        f"{key}: {summary[key]}" for key in PATH_ROWS if summary.get(key) not in (None, "None")
    )


def print_summary(summary: dict[str, Any]) -> None:
    """The summary table, then its paths."""
    Console(width=max(100, Console().width)).print(summary_table(summary))
    paths = summary_paths(summary)
    if paths:
        print(paths, flush=True)


def best_evaluation(rows: list[dict[str, Any]], key: str, label: str) -> dict[str, Any]:
    """The best value of the headline metric over the run's evaluations (the earliest on ties) and
    its step."""
    scored = [(r[key], int(r["step"])) for r in rows if r.get(key) is not None]
    if not scored:
        return {}
    value, step = max(scored, key=lambda vs: (vs[0], -vs[1]))
    return {f"best {label}": value, "best at step": step}


def draw_evaluation(
    task,
    metrics: dict[str, Any],
    run_dir: Path,
    title: str,
    rows: list[dict[str, Any]] | None = None,
) -> list[Path]:
    """The run's PNGs: `curves.png` from the metrics rows (training runs), then the task's per-class
    bars and, for detectors, val images with their predicted boxes."""
    pngs = []
    if rows is not None:
        pngs.append(
            plot_curves(rows, run_dir / "curves.png", title, task.plot_series, task.plot_title)
        )
    pngs += task.plots(metrics, run_dir, title)
    drawn = [p for p in pngs if p is not None]
    if drawn:
        log.info("plots: %s", ", ".join(p.name for p in drawn))
    return drawn


def report_run(
    run_dir: Path,
    summary: dict[str, Any],
    rows: list[dict[str, Any]],
    task,
    last_eval: dict[str, Any],
    title: str,
    written: Optional[Callable[[list[Path]], Any]] = None,
    plots: bool = True,
    longer: str = "",
    under_torchrun: bool = False,
) -> list[Path]:
    """summary.json, the plots (unless not `plots`), the summary table, the task's final line, then
    the run dir and the commands that train it on (`longer`: the length setting that does), evaluate
    and export it (rank 0; `under_torchrun`: the launcher's command trains it on).
    `written(pngs)` runs once the files are written, before anything is
    printed (the trackers take the plots and close there, so that the run's next commands stay its
    last lines). Returns the PNGs."""
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    pngs = draw_evaluation(task, last_eval, run_dir, title, rows) if plots else []
    if written is not None:
        written(pngs)
    print_summary(summary)
    print(task.final_line(last_eval), flush=True)
    print(
        next_commands(
            run_dir, getattr(task, "family", ""), _val_folder(task), longer, under_torchrun
        ),
        flush=True,
    )
    return pngs


def _val_folder(task) -> Optional[Path]:
    """The folder of the task's val images (an ImageFolder split, a COCO image folder, or within it
    the one folder every val image is in: a YOLO set's images/val); None for packed shards."""
    dataset = getattr(getattr(getattr(task, "data", None), "val_loader", None), "dataset", None)
    folder = getattr(dataset, "root", None) or getattr(dataset, "image_root", None)
    if folder is None or not Path(folder).is_dir():
        return None
    paths: Any = getattr(getattr(dataset, "index", None), "paths", None)
    if paths is not None and hasattr(paths, "relative") and len(paths):
        firsts = {Path(paths.relative(i)).parts[:-1][:1] for i in range(len(paths))}
        if len(firsts) == 1 and (only := firsts.pop()):
            return Path(folder) / only[0]
    return Path(folder)
