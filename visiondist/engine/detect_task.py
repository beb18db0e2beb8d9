"""A detector's task (`DetectionTask`): its loaders, the loss the model returns, its COCO box (and
mask) evaluation and how the result is reported (`engine/tasks.py` picks the task of a model's
family).

A classifier's rank never imports what only a detector needs (torchvision's detectors, the COCO
scorer, the DETR family's modules, and torch._dynamo with them: about 1 s of a rank's start): those
are imported where a detector's task needs them (`# noqa: PLC0415 (detector-side)`)."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig
from torch import nn

from visiondist.data import build_detection_data
from visiondist.data.transforms import unit_float
from visiondist.data.workers import watched
from visiondist.models import EVAL_METRICS, eval_metrics, padded_batches
from visiondist.observe.metrics import TRAIN_COLUMNS
from visiondist.observe.plots import at_step, plot_masks, plot_per_class, plot_predictions
from visiondist.parallel import Layout


class DetectionTask:
    columns = (*TRAIN_COLUMNS, *EVAL_METRICS["detection"])
    # the input's resolution is the model's own (min_size / max_size)
    input_fields: dict[str, Any] = {}
    reads = None
    headline = ("val_mAP", "val box mAP@[.5:.95]")
    plot_series: tuple[tuple[str, str], ...] = (
        ("val_mAP", "AP@[.5:.95]"),
        ("val_AP50", "AP50"),
        ("val_AP75", "AP75"),
        ("val_AR100", "AR100"),
        ("val_ema_mAP", "EMA AP@[.5:.95]"),
    )
    plot_title = "val box AP / AR"
    ema_keys: tuple[str, ...] = ("val_mAP",)

    def __init__(self, cfg: DictConfig, layout: Layout, train: bool = True):
        from visiondist.models.detection import has_masks  # noqa: PLC0415 (detector-side)

        t = cfg.trainer
        self.family = str(cfg.model.family)  # the export formats the run's closing lines name
        # Mask R-CNN: targets carry masks; evaluation scores masks too
        self.masks = has_masks(cfg.model)
        self.columns = (*TRAIN_COLUMNS, *eval_metrics(cfg.model))
        if self.masks:
            self.ema_keys = ("val_mAP", "val_segm_mAP")
            self.plot_series = (*self.plot_series, ("val_segm_mAP", "mask AP@[.5:.95]"))
            self.plot_title = "val box / mask AP, box AR"
        # (uint8 loader images, device) -> float in [0, 1] there, as torchvision takes
        self.inputs = unit_float
        # a bar while evaluating, a spinner while scoring
        self.progress = bool(t.progress) and layout.is_main
        self.data = build_detection_data(
            cfg.data,
            layout.dp_rank,
            layout.dp,
            t.grad_accum,
            t.seed,
            pin_memory=layout.device.type == "cuda",
            train=train,
            masks=self.masks,
            **square_input(cfg.model),
            padded_by=padded_batches(cfg.model),
        )
        # the plots' images, from a tree or from shards
        self.val_image = self.data.val_loader.dataset.image_by_id

    def train_batches(self, device: torch.device) -> Iterator:
        """An epoch's training batches."""
        return watched(iter(self.data.train_loader))

    @staticmethod
    def feed(batches: Iterator, device: torch.device) -> Iterator:
        return batches

    @staticmethod
    def decoded_by(device: torch.device) -> str:
        return "OpenCV in the loader workers"

    def loss(
        self,
        model: nn.Module,
        batch: Any,
        device: torch.device,
        autocast: AbstractContextManager,
        key: tuple[int, int] = (0, 0),
    ) -> torch.Tensor:
        images, targets = batch
        images = self.inputs(images, device)
        keys = ("boxes", "labels", "masks") if self.masks else ("boxes", "labels")
        targets = [{k: t[k].to(device) for k in keys} for t in targets]
        with autocast:
            losses = model(images, targets)
        return sum(loss.float() for loss in losses.values())

    def evaluate(self, model: nn.Module, layout: Layout, autocast, run_dir: Path) -> dict[str, Any]:
        from visiondist.evaluation.detection import (  # noqa: PLC0415 (detector-side)
            evaluate_detection,
        )

        d = self.data
        metrics = evaluate_detection(
            model,
            d.val_loader,
            layout,
            d.val_annotations,
            d.cat_of_label,
            d.num_val,
            autocast,
            run_dir / "detections.json" if layout.is_main else None,
            self.progress,
        )
        if layout.is_main:  # per-category AP of the latest evaluation, by category name
            (run_dir / "per_class.json").write_text(json.dumps(metrics["val_class_AP"], indent=1))
        return metrics

    def plots(self, m: dict[str, Any], run_dir: Path, title: str) -> list[Path]:
        """The per-category AP bars and a few val images with their predicted boxes (and masks), of
        the latest evaluation."""
        d = self.data
        ap = {
            name: None if v is None else 100 * v
            for name, v in (m.get("val_class_AP") or {}).items()
        }
        pngs = [
            plot_per_class(
                ap,
                run_dir / "per_class_ap.png",
                f"{title}: box AP per category{at_step(m)}",
                "AP@[.5:.95] (%)",
            ),
            plot_predictions(
                run_dir / "detections.json",
                d.val_annotations,
                self.val_image,
                run_dir / "val_predictions.png",
                title,
            ),
        ]
        if self.masks:
            pngs.append(
                plot_masks(
                    run_dir / "segmentations.json",
                    d.val_annotations,
                    self.val_image,
                    run_dir / "val_masks.png",
                    title,
                )
            )
        return [p for p in pngs if p is not None]

    @staticmethod
    def describe(m: dict[str, Any]) -> str:
        masks = f" | mask mAP {m['val_segm_mAP']:.4f}" if "val_segm_mAP" in m else ""
        return (
            f"box mAP {m['val_mAP']:.4f} | AP50 {m['val_AP50']:.4f} | AP75 {m['val_AP75']:.4f} | "
            f"AR100 {m['val_AR100']:.4f}{masks} | {m['val_count']} images, {m['val_detections']} "
            "detections"
        )

    @staticmethod
    def summary(m: dict[str, Any]) -> dict[str, Any]:
        masks = (
            {"val mask mAP@[.5:.95]": m["val_segm_mAP"], "val mask AP50": m["val_segm_AP50"]}
            if "val_segm_mAP" in m
            else {}
        )
        return {
            "val box mAP@[.5:.95]": m["val_mAP"],
            "val AP50": m["val_AP50"],
            "val AP75": m["val_AP75"],
            "val AR100": m["val_AR100"],
            **masks,
            "val images": m["val_count"],
        }

    @staticmethod
    def final_line(m: dict[str, Any]) -> str:
        """The 12-line COCOeval summary of the boxes (and of the masks) and the headline
        figure(s)."""
        from visiondist.evaluation.coco_scoring import summary_lines  # noqa: PLC0415 (detector-side)

        box = {
            k[4:]: v for k, v in m.items() if k.startswith("val_") and not k.startswith("val_segm_")
        }
        if "val_segm_mAP" not in m:
            return f"{summary_lines(box)}\nval box mAP@[.5:.95]: {m['val_mAP']:.4f}"
        segm = {k[9:]: v for k, v in m.items() if k.startswith("val_segm_")}
        return (
            f"bbox:\n{summary_lines(box)}\nsegm:\n{summary_lines(segm)}\n"
            f"val box mAP@[.5:.95]: {m['val_mAP']:.4f}  mask mAP@[.5:.95]: {m['val_segm_mAP']:.4f}"
        )


def square_input(model_cfg) -> dict[str, Any]:
    """A DETR-class detector's training images: resized by the loader straight to its square input,
    as its image processor resizes (antialiased when shrinking where it is); other detectors: none
    (data.min_size / max_size)."""
    if model_cfg.family != "detr":
        return {}
    from visiondist.models.detr_archs import ARCHS  # noqa: PLC0415 (detector-side)

    return {"square": int(model_cfg.img_size), "antialias": ARCHS[model_cfg.arch].antialias}
