"""`tools/export.py run_dir=<run> benchmark=true`: every deployable form of a run side by side, on
this machine, in one run: PyTorch eager and compiled, then each file written (ONNX in float32,
float16 and int8; OpenVINO's IR; a classifier's pt2 program): its size, its val accuracy (the file
evaluated as `tools/eval.py weights=` evaluates it) and its latency at batch 1 and 8 (the median of
`ROUNDS` calls after `WARMUP`, each call the model's whole answer: a detector's images in, its boxes
out). A table on the screen, `benchmark.md` and `benchmark.json` in `<run>/export/benchmark/`.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

from visiondist.api.export_job import evaluate_file, headline
from visiondist.api.jobs import CHATTY
from visiondist.config import ConfigError
from visiondist.utils.logs import held_at

WARMUP, ROUNDS = 3, 15
BATCHES = (1, 8)
# name, format, export settings (the file's name: model<tag><suffix>)
FILES: tuple[tuple[str, str, dict[str, Any], str], ...] = (
    ("ONNX", "onnx", {}, ".onnx"),
    ("ONNX float16", "onnx", {"half": True}, "_fp16.onnx"),
    ("ONNX int8", "onnx", {"int8": True}, "_int8.onnx"),
    ("OpenVINO", "openvino", {}, "_openvino.xml"),
    ("pt2", "pt2", {}, ".pt2"),
)


def export_benchmark(
    run_dir: Union[str, Path], step: Optional[Union[int, str]] = None
) -> list[dict[str, Any]]:
    """The rows (module docstring) of the run's checkpoint (`step`, else its newest, else its
    model.safetensors); printed as a table and written beside the files.

    Returns:
        One dict a form: name, file, MiB, the val metric's name and value, ms at each batch.
    """
    # as the tools' logging set-up holds them; a notebook sets up none
    with held_at(logging.ERROR, CHATTY):
        return _benchmark(Path(run_dir).expanduser(), step)


def _benchmark(run_dir: Path, step: Optional[Union[int, str]]) -> list[dict[str, Any]]:
    import torch  # noqa: PLC0415 (a job's)

    from visiondist.checkpoint.export import export  # noqa: PLC0415 (a job's)
    from visiondist.checkpoint.export.runtimes import load_runtime  # noqa: PLC0415
    from visiondist.checkpoint.export.trained import load_trained  # noqa: PLC0415
    from visiondist.models import TASKS  # noqa: PLC0415 (a job's)

    try:
        trained = load_trained(run_dir, step)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    work = run_dir / "export" / "benchmark"
    work.mkdir(parents=True, exist_ok=True)
    classifier = TASKS[trained.cfg.model.family] == "classification"
    inputs = _inputs(trained, classifier)
    cpu = torch.device("cpu")
    weights = trained.source if trained.source.exists() else run_dir / "model.safetensors"
    eager_score = _score(run_dir, weights, work / "eval_pytorch")
    print(
        f"timing {trained.cfg.model.name} from {trained.source} on this machine's CPU", flush=True
    )
    rows = [
        _row("PyTorch eager", None, eager_score, trained.model, inputs),
        _row("PyTorch compiled", None, None, torch.compile(trained.model), inputs),
    ]
    for name, fmt, settings, suffix in FILES:
        if fmt == "pt2" and not classifier:
            continue
        path = work / f"model{suffix}"
        try:
            export(trained, fmt, path, **settings)
        except ValueError as exc:  # int8 without the train images, no OpenVINO: the row says why
            rows.append({"form": name, "file": None, "skipped": str(exc).splitlines()[0]})
            continue
        try:
            model = load_runtime(trained.cfg.model, path, cpu)
            score = _score(run_dir, path, work / f"eval_{path.stem}")
            rows.append(_row(name, path, score, model, inputs))
        except Exception as exc:  # a runtime's own error: the other rows are still the table's
            why = f"failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}"
            print(f"  {name}: {why}", flush=True)
            rows.append({"form": name, "file": str(path), "skipped": why[:200]})
    _write(rows, work, trained)
    return rows


def _inputs(trained, classifier: bool) -> dict[int, Any]:
    """Each batch's input: a classifier's random normalised crops, a detector's val images (its
    originals, random ones where the data is not here)."""
    import torch  # noqa: PLC0415 (a job's)

    from visiondist.checkpoint.export.images import detection_images  # noqa: PLC0415
    from visiondist.checkpoint.export.trained import example_images  # noqa: PLC0415

    if classifier:
        return {b: example_images(trained.cfg, b) for b in BATCHES}
    found, _ = detection_images(trained.cfg, trained.cfg.data.val_split, max(BATCHES))
    images = [image for _, image in found]
    generator = torch.Generator().manual_seed(0)
    while len(images) < max(BATCHES):
        images.append(example_images(trained.cfg, 1)[0].uniform_(generator=generator))
    return {b: images[:b] for b in BATCHES}


def _score(run_dir: Path, weights: Path, out: Path) -> Optional[tuple[str, float, Optional[int]]]:
    """(metric, value, val images) of `weights` evaluated under the run's config; None where the
    val split is not on this machine."""
    try:
        metrics = evaluate_file(run_dir, weights, out)
    except ConfigError:
        return None
    return headline(metrics)


def _row(name: str, path: Optional[Path], score, model: Callable, inputs: dict) -> dict[str, Any]:
    import torch  # noqa: PLC0415 (a job's)

    print(f"  {name}: {'evaluated, ' if score else ''}timing at batch 1 and 8", flush=True)
    row: dict[str, Any] = {"form": name, "file": str(path) if path else None}
    # an IR's weights are its .bin
    files = [path, *([path.with_suffix(".bin")] if path.suffix == ".xml" else [])] if path else []
    row["MiB"] = round(sum(f.stat().st_size for f in files) / 2**20, 2) if path else None
    if score is not None:
        row["metric"], row["value"], row["val_images"] = score
    with torch.no_grad():
        for batch, x in inputs.items():
            for _ in range(WARMUP):
                model(x)
            times = []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                model(x)
                times.append(time.perf_counter() - start)
            row[f"ms_batch{batch}"] = round(1000 * statistics.median(times), 2)
    return row


def _write(rows: list[dict[str, Any]], work: Path, trained) -> None:
    """The table printed and written (benchmark.md), the rows as JSON (benchmark.json)."""
    metric = next((r["metric"] for r in rows if "metric" in r), "accuracy")
    images = next((r["val_images"] for r in rows if "val_images" in r), None)
    on = f" ({images} images)" if images else ""
    head = ["form", "MiB", f"val {metric}{on}", *(f"ms, batch {b}" for b in BATCHES)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['form']} | - | {r['skipped']} |" + " - |" * len(BATCHES))
            continue
        value = (
            "-"
            if "value" not in r
            else f"{r['value']:.2f}"
            if metric == "top-1"
            else (f"{r['value']:.4f}")
        )
        cells = [r["form"], "-" if r["MiB"] is None else f"{r['MiB']:.1f}", value]
        cells += [f"{r[f'ms_batch{b}']:.1f}" for b in BATCHES]
        lines.append("| " + " | ".join(cells) + " |")
    title = (
        f"{trained.cfg.model.name} from {trained.source}, on this machine's CPU "
        f"(median of {ROUNDS} calls after {WARMUP})"
    )
    table = "\n".join([title, "", *lines])
    print(table)
    (work / "benchmark.md").write_text(table + "\n")
    (work / "benchmark.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"written: {work / 'benchmark.md'}, {work / 'benchmark.json'}")
