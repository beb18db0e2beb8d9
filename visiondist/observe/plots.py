"""PNG plots a run writes into its directory (rank 0, matplotlib's Agg canvas, nothing shown, pyplot
not imported):

- `curves.png`: training loss, learning rate and the evaluation metrics against the step;
- classification: `per_class_top1.png` and, up to 100 classes, `confusion.png`; detection:
  `per_class_ap.png` (AP@[.5:.95] of every category, from COCOeval's precision array) and
  `val_predictions.png` (a few val images with ground truth and predicted boxes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from pycocotools import mask as mask_utils


def _figure(**kw):
    """A matplotlib Figure drawn by Agg when saved, without pyplot (its import and its figure
    registry: about a third of a second a process)."""
    # matplotlib: 0.4 s a process, imported only where a plot is drawn (here and below)
    from matplotlib.figure import Figure  # noqa: PLC0415 (matplotlib: 0.4 s)

    return Figure(**kw)


def plot_curves(
    rows: list[dict[str, Any]],
    png: Path,
    title: str,
    val_series: Sequence[tuple[str, str]] = (("val_top1", "top-1"),),
    val_title: str = "val accuracy (%)",
) -> Optional[Path]:
    """Loss, learning rate and the evaluation metrics (`val_series`: (metrics.csv column, legend
    label)) against the step, side by side; None when there is nothing to draw."""
    train = [r for r in rows if r.get("loss") is not None]
    evals = [r for r in rows if any(r.get(key) is not None for key, _ in val_series)]
    if not train and not evals:
        return None
    fig = _figure(figsize=(14, 3.8))
    axes = fig.subplots(1, 3)
    marker = {"marker": "o"} if len(train) < 30 else {}
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], **marker)
    axes[0].set_title("train loss")
    axes[1].plot([r["step"] for r in train], [r["lr"] for r in train], **marker)
    axes[1].set_title("learning rate")
    for key, label in val_series:
        points = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        if points:
            axes[2].plot(*zip(*points), marker="o", label=label)
    if evals:
        axes[2].legend(loc="best", fontsize="small")
    axes[2].set_title(val_title)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return _save(fig, png)


def plot_per_class(
    values: dict[str, Optional[float]], png: Path, title: str, xlabel: str
) -> Optional[Path]:
    """Horizontal bars of a per-class metric in % (AP per category, top-1 per class), best first,
    with their mean; classes without a value (no ground truth) are left out."""
    scored = sorted(((v, name) for name, v in values.items() if v is not None), reverse=True)
    if not scored:
        return None
    fig = _figure(figsize=(7, 1.2 + 0.22 * len(scored)))
    ax = fig.subplots()
    bars = [v for v, _ in scored]
    ax.barh(range(len(scored)), bars, color="tab:blue")
    ax.set_yticks(
        range(len(scored)), [name for _, name in scored], fontsize=8 if len(scored) > 30 else 10
    )
    ax.invert_yaxis()
    mean = sum(bars) / len(bars)
    ax.axvline(mean, color="tab:red", linestyle="--", label=f"class mean {mean:.1f}")
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, max(100.0, max(bars)))
    ax.legend(loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title)
    return _save(fig, png)


def plot_confusion(
    matrix: list[list[int]], names: list[str], png: Path, title: str
) -> Optional[Path]:
    """The confusion matrix, each row (a true class) as the share of its images predicted as each
    class, with the counts written in where there is room (up to 20 classes); None without
    images."""
    counts = np.asarray(matrix, dtype=np.float64)
    totals = counts.sum(axis=1, keepdims=True)
    if not totals.any():
        return None
    shares = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    k = len(names)
    side = min(16.0, 2.5 + 0.45 * k)
    fig = _figure(figsize=(side + 1.2, side))
    ax = fig.subplots()
    shown = ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04, label="share of the true class's images")
    size = 8 if k > 12 else 10
    # the column names slanted (upright from 13 classes) where side by side they would meet
    slant = 90 if k > 12 else 45 if k > 2 or max(map(len, names)) > 8 else 0
    ax.set_xticks(
        range(k), names, rotation=slant, fontsize=size, ha="right" if slant == 45 else "center",
        rotation_mode="anchor" if slant == 45 else "default",
    )  # fmt: skip
    ax.set_yticks(range(k), names, fontsize=size)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if k <= 20:
        for (i, j), n in np.ndenumerate(counts):
            if n:
                dark = shares[i, j] > 0.5
                ax.text(j, i, int(n), ha="center", va="center", fontsize=size,
                        color="white" if dark else "black")  # fmt: skip
    ax.set_title(title)
    return _save(fig, png)


def plot_predictions(
    detections_json: Path,
    ann_file: Path,
    read_image,
    png: Path,
    title: str,
    images: int = 4,
    min_score: float = 0.25,
) -> Optional[Path]:
    """The first `images` val images (by id) with their ground-truth boxes (green) and the predicted
    boxes scoring at least `min_score` (red, with category and score), from a COCO results file. An
    image with no prediction that sure shows its best ones instead, as many as it has true boxes
    (dotted: an early model's guesses are visible). `read_image(image entry of the annotation file)`
    gives its upright pixels (the val set's `image_by_id`)."""
    gt = json.loads(Path(ann_file).read_text())
    if not gt["images"] or not Path(detections_json).is_file():
        return None
    names = {c["id"]: c["name"] for c in gt["categories"]}
    chosen = sorted(gt["images"], key=lambda im: im["id"])[:images]
    ids = {im["id"] for im in chosen}
    truth: dict[int, list] = {i: [] for i in ids}
    for ann in gt["annotations"]:
        if ann["image_id"] in ids:
            truth[ann["image_id"]].append(ann)
    predicted, unsure = _shown(
        detections_json, {i: len(anns) for i, anns in truth.items()}, min_score
    )
    from matplotlib.patches import Rectangle  # noqa: PLC0415 (matplotlib: 0.4 s)

    fig, axes = _image_grid(len(chosen))
    for ax, image in zip(axes.flat, chosen):
        ax.imshow(read_image(image))  # upright, as the boxes were annotated
        for ann in truth[image["id"]]:
            x, y, w, h = ann["bbox"]
            ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="lime", linewidth=1.5))
        for det in predicted[image["id"]]:
            x, y, w, h = det["bbox"]
            ax.add_patch(
                Rectangle(
                    (x, y),
                    w,
                    h,
                    fill=False,
                    edgecolor="red",
                    linewidth=1.2,
                    linestyle=":" if image["id"] in unsure else "--",
                )
            )
            ax.text(
                x,
                y,
                f"{names.get(det['category_id'], det['category_id'])} {det['score']:.2f}",
                color="white",
                fontsize=7,
                va="bottom",
                bbox={"facecolor": "red", "alpha": 0.6, "pad": 1, "linewidth": 0},
            )
        shown = (
            f"best {len(predicted[image['id']])} predicted, below {min_score}"
            if image["id"] in unsure
            else f"{len(predicted[image['id']])} predicted"
        )
        ax.set_title(f"image {image['id']}: {len(truth[image['id']])} true, {shown}", fontsize=9)
    fig.suptitle(f"{title} (green: ground truth, red: predictions with score >= {min_score})")
    return _save(fig, png)


def plot_masks(
    segmentations_json: Path,
    ann_file: Path,
    read_image,
    png: Path,
    title: str,
    images: int = 4,
    min_score: float = 0.25,
) -> Optional[Path]:
    """The first `images` val images (by id) with the predicted masks scoring at least `min_score`
    laid over them, one colour per instance (the best ones, as many as the true objects, where none
    is that sure), and the ground-truth count, from a COCO segm results file."""
    if not Path(segmentations_json).is_file():
        return None

    gt = json.loads(Path(ann_file).read_text())
    chosen = sorted(gt["images"], key=lambda im: im["id"])[:images]
    if not chosen:
        return None
    truth = {
        im["id"]: sum(
            a["image_id"] == im["id"] and not a.get("iscrowd", 0) for a in gt["annotations"]
        )
        for im in chosen
    }
    shown, _ = _shown(segmentations_json, truth, min_score)
    from matplotlib import colormaps  # noqa: PLC0415 (matplotlib: 0.4 s)

    colours = colormaps["tab10"]
    fig, axes = _image_grid(len(chosen))
    for ax, image in zip(axes.flat, chosen):
        sure = shown[image["id"]]
        pixels = np.asarray(read_image(image), dtype=np.float32) / 255
        for k, det in enumerate(sure):
            rle = dict(det["segmentation"], counts=det["segmentation"]["counts"].encode())
            mask = mask_utils.decode(rle).astype(bool)
            pixels[mask] = 0.55 * pixels[mask] + 0.45 * np.asarray(
                colours(k % 10)[:3], dtype=np.float32
            )
        ax.imshow(pixels)
        ax.set_title(
            f"image {image['id']}: {truth[image['id']]} true, {len(sure)} masks shown", fontsize=9
        )
    fig.suptitle(f"{title} (predicted masks, score >= {min_score} or the best ones)")
    return _save(fig, png)


def _shown(
    results_json: Path, true_counts: dict[int, int], min_score: float
) -> tuple[dict[int, list], set[int]]:
    """Per image id of `true_counts`, the results of a COCO results file to draw, best first: those
    scoring at least `min_score`; where none does, the best ones, as many as the image's true
    objects (at least 1), and the image is in the second value (an early model's guesses stay
    visible)."""
    found: dict[int, list] = {i: [] for i in true_counts}
    for det in json.loads(Path(results_json).read_text()):
        if det["image_id"] in found:
            found[det["image_id"]].append(det)
    shown, unsure = {}, set()
    for i, dets in found.items():
        dets.sort(key=lambda d: -d["score"])
        shown[i] = [d for d in dets if d["score"] >= min_score]
        if not shown[i] and dets:
            shown[i] = dets[: max(1, true_counts[i])]
            unsure.add(i)
    return shown, unsure


def _save(fig, png: Path) -> Path:
    """Lay out `fig` and write it to `png`."""
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return png


def _image_grid(n: int):
    """A figure of `n` image panels, up to 4 a row, without axes."""
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig = _figure(figsize=(4 * cols, 4 * rows + 0.4))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    return fig, axes


def at_step(m: dict) -> str:
    """' at step N' of an evaluation's metrics `m` that name their step, for a plot's title."""
    return f" at step {m['step']}" if m.get("step") is not None else ""
