"""What rank 0 shows and leaves for people: the live progress bar, and at the end the summary (printed as a table,
written as summary.json) with the PNG plots of the run."""

from __future__ import annotations

import json
import logging
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Optional

from visiondist.engine.logging import summary_table
from visiondist.engine.plots import plot_curves

log = logging.getLogger(__name__)


def progress_bar(enabled: bool, total: int):
    """A rich progress bar over the optimizer steps (None when disabled): the bar, steps done, the latest log line's
    figures (epoch, loss, lr, images/s, GPU memory), elapsed and remaining time."""
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    )
    progress.start()
    progress.add_task("train", total=total, stats="")
    return progress


def tracked(items, enabled: bool, description: str = "eval"):
    """`items` with a transient rich progress bar while they are consumed (rank 0 with `trainer.progress`), e.g. an
    evaluation's batches; under the live training bar it shows beneath it. Every item also tells the rank's hang
    watchdog that the work moves (on every rank)."""
    from visiondist.engine.failures import PROGRESS

    def beating(iterable):
        for item in iterable:
            PROGRESS.at()
            yield item

    if not enabled:
        return beating(items)
    from rich.progress import track

    return beating(track(items, description=description, total=len(items), transient=True))


def status(enabled: bool, text: str):
    """A transient spinner with `text` while a long step without batches runs (e.g. COCO scoring on rank 0)."""
    if not enabled:
        return nullcontext()
    from rich import get_console

    return get_console().status(text)


def best_evaluation(rows: list[dict[str, Any]], key: str, label: str) -> dict[str, Any]:
    """The best value of the headline metric over the run's evaluations (the earliest on ties) and its step."""
    scored = [(r[key], int(r["step"])) for r in rows if r.get(key) is not None]
    if not scored:
        return {}
    value, step = max(scored, key=lambda vs: (vs[0], -vs[1]))
    return {f"best {label}": value, "best at step": step}


def draw_evaluation(task, metrics: dict[str, Any], run_dir: Path, title: str,
                    rows: list[dict[str, Any]] | None = None) -> list[Path]:
    """The run's PNGs: `curves.png` from the metrics rows (training runs), then the task's per-class bars and, for
    detectors, val images with their predicted boxes."""
    pngs = []
    if rows is not None:
        pngs.append(plot_curves(rows, run_dir / "curves.png", title, task.plot_series, task.plot_title))
    pngs += task.plots(metrics, run_dir, title)
    pngs = [p for p in pngs if p is not None]
    if pngs:
        log.info("plots: %s", ", ".join(p.name for p in pngs))
    return pngs


def run_summary(tr, final_loss: float, train_time: float, weights: Path) -> dict[str, Any]:
    """The summary of a finished run (table, summary.json): the trainer `tr`'s figures, its task's last evaluation."""
    from visiondist.data.robust import count_bad_images
    from visiondist.engine.build import precision_text

    if math.isnan(final_loss):  # nothing trained in this process (resumed at the end): the run's last logged loss
        final_loss = next((r["loss"] for r in reversed(tr.metrics.rows) if r.get("loss") is not None), math.nan)
    ran = tr.step - tr.resumed_from_step
    batch = tr.cfg.data.batch_size
    whole = tr.earlier_seconds + train_time if tr.earlier_seconds is not None else None  # every attempt's

    def rate(steps: int, seconds: float | None) -> float | None:
        return float(f"{steps * batch / seconds:.3g}") if steps and seconds else None

    summary = {
        "model": tr.cfg.model.name,
        "parameters (M)": round(tr.num_params / 1e6, 3),
        "parameters per rank (M)": round(tr.rank_params / 1e6, 3),
        "layout": tr.layout_text,
        "precision": precision_text(tr.cfg.trainer, tr.layout.device),
        "data": f"{tr.cfg.data.name}: {tr.data.num_train} train / {tr.data.num_val} val images"
                + (f" (shards of {tr.cfg.data.root})" if tr.cfg.data.get("format") == "shards" else ""),
        "steps": tr.step,
        "epochs": float(f"{tr.step / tr.data.train_sampler.steps_per_epoch:.3g}"),
        "train time (s)": round(whole, 1) if whole is not None else None,  # the whole run's, over its attempts
        "throughput (img/s)": rate(tr.step, whole),
        **({"this attempt": f"steps {tr.resumed_from_step + 1}-{tr.step}: {train_time:.1f} s, "
                            f"{rate(ran, train_time)} img/s"} if tr.resumed_from_step else {}),
        "final train loss": None if math.isnan(final_loss) else final_loss,
        **best_evaluation(tr.metrics.rows, *tr.task.headline),
        **({"skipped steps (non-finite)": tr.skipped_steps} if tr.skipped_steps else {}),
        **({"skipped steps (fp16 overflow)": tr.overflow_steps} if tr.overflow_steps else {}),
        **({"fp16 loss scale": _exact(tr.scaler.get_scale())} if tr.scaler is not None else {}),
        **({"unreadable train images (replaced)": bad} if (bad := count_bad_images(tr.run_dir)) else {}),
        **_device_decoding(tr),
        **_shard_fetches(tr),
        **({"TP traffic per step (MB)": round(tr.tp_bytes_per_step / 1e6, 2)} if tr.tp_bytes_per_step else {}),
        **({"PP traffic per step (MB)": round(tr.pp_bytes_per_step / 1e6, 2)} if tr.pp_bytes_per_step else {}),
        **({"pipeline": f"{tr.pipeline.schedule_name}, {tr.pipeline.microbatches} micro-batches"}
           if tr.pipeline is not None else {}),
        **({"pipeline bubble (%)": round(100 * tr.bubble, 1)} if tr.bubble is not None else {}),
        **tr.task.summary(tr.last_eval),
        **({"peak GPU memory (GiB)": round(tr.peak_gpu_gib(), 2)} if tr.layout.device.type == "cuda" else {}),
        "checkpoint": str(tr.last_checkpoint),
        **({"checkpoint stall (s, mean)": round(sum(tr.checkpoint_stall_s) / len(tr.checkpoint_stall_s), 3)}
           if tr.checkpoint_stall_s else {}),
        **_best_row(tr),
        "weights": str(weights),
        "run dir": str(tr.run_dir),
    }
    return summary


def _best_row(tr) -> dict[str, Any]:
    """`trainer.best_metric`: the best checkpoint the run kept (this process's or, resumed, an earlier one's)."""
    from visiondist.engine.checkpoint import CHECKPOINTS, read_best

    best = tr.best or (read_best(tr.run_dir) if tr.cfg.trainer.best_metric else None)
    if not best:
        return {}
    return {f"best {best['metric']}": f"{best['value']:.6g} at step {best['step']} "
                                      f"({tr.run_dir / CHECKPOINTS / ('step_' + str(best['step']))})"}


def _device_decoding(tr) -> dict:
    """data.decode_on=device: how many of rank 0's training images the device decoded, and with what."""
    count = getattr(tr.task, "worker_decoded", None)
    if count is None or not count.images:
        return {}
    from visiondist.data.device_decode import decoder_name

    return {"decode_on=device (rank 0)": f"{count.images - count.fallbacks} of {count.images} images by "
                                         f"{decoder_name(tr.layout.device)}, {count.fallbacks} in the loader workers"}


def _shard_fetches(tr) -> dict:
    """data.format=shards from a URL: the MB of shards and indexes each DP rank (with its loader workers) fetched into
    its node's cache, gathered from every rank (a collective: every rank builds the summary). A directory is read in
    place: nothing fetched, no row."""
    from visiondist.data.shards.store import is_url

    if tr.cfg.data.get("format") != "shards" or not is_url(str(tr.cfg.data.root)):
        return {}
    import torch.distributed as dist

    store = getattr(tr.data, "store", None)
    mine = round(store.fetched.value / 1e6, 3) if store is not None else 0.0
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    return {"shard MB fetched per rank": every}


def _exact(value: float) -> float | int:
    """A whole number as an int (the summary table prints floats to 4 digits: 65536, not 6.554e+04)."""
    return int(value) if value.is_integer() else value


def report_run(run_dir: Path, summary: dict[str, Any], rows: list[dict[str, Any]], task, last_eval: dict[str, Any],
               title: str, written: Optional[Callable[[list[Path]], Any]] = None) -> list[Path]:
    """summary.json, the plots, the summary table, the task's final line, then the run dir and the commands that
    evaluate and export it (rank 0). `written(pngs)` runs once the files are written, before anything is printed
    (the trackers take the plots and close there, so that the run's next commands stay its last lines). Returns the
    PNGs."""
    from rich.console import Console

    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    pngs = draw_evaluation(task, last_eval, run_dir, title, rows)
    if written is not None:
        written(pngs)
    Console(width=max(100, Console().width)).print(summary_table(summary))
    print(task.final_line(last_eval), flush=True)
    print(next_commands(run_dir), flush=True)
    return pngs


def next_commands(run_dir: Path) -> str:
    """Where a training run is, and what to run on it next, in the tools' key=value convention."""
    import shlex

    run = shlex.quote(shown_path(run_dir))
    return (f"run dir: {run}\n"
            f"  evaluate: python {tool_path('eval')} run_dir={run}\n"
            f"  export:   python {tool_path('export')} run_dir={run}   (format=onnx or format=torchscript for those)")


def tool_path(name: str) -> str:
    """`tools/<name>.py` as the user can type it from where they are (relative inside the working directory, else
    absolute); `tools/<name>.py` when the package was installed without its tools."""
    import shlex

    import visiondist

    path = Path(visiondist.__file__).resolve().parents[1] / "tools" / f"{name}.py"
    return shlex.quote(shown_path(path)) if path.is_file() else f"tools/{name}.py"


def shown_path(path: Path) -> str:
    """`path` relative to the working directory when it is inside it (what a user types), else as it is."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
