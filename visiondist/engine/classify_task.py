"""A classifier's task (`ClassificationTask`): its loaders (the input's resolution, mixing, device
augmentation and JPEG decoding), its loss, its top-1 / top-5 evaluation and how the result is
reported (`engine/tasks.py` picks the task of a model's family)."""

from __future__ import annotations

import json
import logging
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from visiondist.config.resolution import native_settings, reading
from visiondist.data import build_classification_data
from visiondist.data.augment_ops import DeviceAugment
from visiondist.data.decode_ahead import DecodeAhead
from visiondist.data.decode_fallback import FallbackCount
from visiondist.data.device_decode import EncodedBatch, decoder_name
from visiondist.data.mixing import Mixing
from visiondist.data.transforms import Normalize
from visiondist.data.workers import watched
from visiondist.evaluation.classification import evaluate_classification, reports_top5
from visiondist.models import EVAL_METRICS
from visiondist.observe.metrics import TRAIN_COLUMNS
from visiondist.observe.plots import at_step, plot_confusion, plot_per_class
from visiondist.parallel import Layout

log = logging.getLogger(__name__)


def confused_with(m: dict[str, Any], classes: Sequence[str], i: int, shown: int = 3) -> dict:
    """The classes the `i`-th class's images were most often predicted as (the confusion matrix's
    row, the diagonal left out): {"confused_with": {name: images, ...}}, the largest first; {} where
    none was, or no matrix was counted."""
    rows = m.get("val_confusion")
    if not rows:
        return {}
    wrong = sorted(
        ((n, classes[j]) for j, n in enumerate(rows[i]) if j != i and n), key=lambda t: -t[0]
    )
    return {"confused_with": {name: n for n, name in wrong[:shown]}} if wrong else {}


class ClassificationTask:
    columns: tuple[str, ...] = (*TRAIN_COLUMNS, *EVAL_METRICS["classification"])
    headline = ("val_top1", "val top-1 (%)")
    plot_series: tuple[tuple[str, str], ...] = (
        ("val_top1", "top-1"),
        ("val_top5", "top-5"),
        ("val_ema_top1", "EMA top-1"),
    )
    plot_title = "val accuracy (%)"
    ema_keys: tuple[str, ...] = ("val_loss", "val_top1", "val_top5")

    def __init__(self, cfg: DictConfig, layout: Layout, train: bool = True):
        t, d = cfg.trainer, cfg.data
        # (uint8 loader images, device) -> the model's input there
        self.inputs = Normalize(d.mean, d.std)
        # the export formats the run's closing lines name: a native run's timm model is NaFlexVit
        self.family = "native" if d.get("resolution", "square") == "native" else ""
        # eval.json and summary.json say how images were read
        self.input_fields = self._input_fields(cfg, train)
        # evaluation's log line
        self.reads = reading(d, cfg.model.img_size, cfg.model.get("patch_size", 16))
        self.label_smoothing = float(t.label_smoothing)
        # timm's Mixup / CutMix, each draw keyed by (step, micro-batch): see data.mixing
        self.mixing = None
        if d.mixup > 0 or d.cutmix > 0:
            self.mixing = Mixing(
                d, cfg.model.num_classes, self.label_smoothing, t.seed, layout.dp_rank
            )
            if train and layout.is_main:
                kinds = [
                    f"{name} (alpha {a:g})"
                    for name, a in (("mixup", d.mixup), ("cutmix", d.cutmix))
                    if a
                ]
                switch = (
                    f"; cutmix with probability {d.mixup_switch_prob:g}" if len(kinds) == 2 else ""
                )
                smoothing = (
                    f", label smoothing {self.label_smoothing:g} folded in"
                    if self.label_smoothing
                    else ""
                )
                log.info(
                    "%s: a micro-batch mixed with probability %g%s; soft targets%s",
                    " or ".join(kinds),
                    d.mixup_prob,
                    switch,
                    smoothing,
                )
        self.image_shape = (3, cfg.model.img_size, cfg.model.img_size)
        # JPEGs decoded ahead of the step (and eval)
        self.decode_ahead = d.get("decode_on", "loader") == "device"
        self.augment = DeviceAugment(d, cfg.model.img_size) if train else None
        # data.decode_on=device: the images the device could not decode
        self.worker_decoded = FallbackCount()
        self.progress = bool(t.progress) and layout.is_main  # a bar while evaluating
        self.data = build_classification_data(
            cfg.data,
            cfg.model.img_size,
            layout.dp_rank,
            layout.dp,
            t.grad_accum,
            t.seed,
            pin_memory=layout.device.type == "cuda",
            reads_images=layout.reads_images,
            reads_labels=layout.reads_labels,
            train=train,  # evaluation reads the val split only
            patch_size=cfg.model.get("patch_size", 16),
        )
        self.top5 = reports_top5(len(self.data.classes))
        # a few classes: top-5 says nothing (evaluation.classification.reports_top5)
        if not self.top5:
            self.columns = tuple(c for c in self.columns if c not in ("val_top5", "val_ema_top5"))
            self.plot_series = tuple(s for s in self.plot_series if s[0] != "val_top5")
            self.ema_keys = tuple(k for k in self.ema_keys if k != "val_top5")

    def _input_fields(self, cfg: DictConfig, train: bool) -> dict[str, Any]:
        """The input's resolution as eval.json and summary.json state it: the square size, or under
        data.resolution=native the sequence lengths (resolved: the config keeps -1 / null for the
        defaults)."""
        if self.family != "native":
            return {"resolution": f"square, {cfg.model.img_size} px"}
        lens, eval_len = native_settings(
            cfg.data, cfg.model.img_size, cfg.model.get("patch_size", 16)
        )
        fields = {
            "resolution": "native (each image at its own aspect ratio)",
            "val patches per image": eval_len,
        }
        if train:
            fields["train sequence lengths (patches)"] = lens
            fields["packed"] = bool(cfg.data.native.pack)
        return fields

    def train_batches(self, device: torch.device) -> Iterator:
        """An epoch's training batches (`feed`). The loader's iterator is made here, in the main
        thread: the loader watches its workers from there."""
        return self.feed(watched(iter(self.data.train_loader)), device)

    def feed(self, batches: Iterator, device: torch.device) -> Iterator:
        """`batches` as the step takes them: under data.decode_on=device each batch's JPEGs decoded
        on `device` one batch ahead of the step, off its stream (`DecodeAhead`: close it when
        done)."""
        if not self.decode_ahead:
            return batches
        return DecodeAhead(batches, device)

    def decoded_by(self, device: torch.device) -> str:
        """Which decoder reads the images (data.decode_on): the evaluation says it, since nvJPEG and
        OpenCV differ."""
        if not self.decode_ahead:
            return "OpenCV in the loader workers (data.decode_on=loader)"
        return (
            f"{decoder_name(device)} on {device} (data.decode_on=device; other files in the "
            "loader workers)"
        )

    def prepare(
        self, batch: Any, device: torch.device, key: tuple[int, int] | None = None
    ) -> tuple[Any, Any]:
        """(model input, target) of a loader batch on `device`; either side may be None (pipeline
        ranks that hold only one). `key` = (step, micro-batch) mixes them (training with mixup /
        cutmix): soft targets then."""
        # rows: the samples' augmentation parameters (`visiondist.data.augment`)
        images, labels, *rows = batch
        # data.decode_on=device: count what the workers decoded
        if isinstance(images, EncodedBatch):
            self.worker_decoded.add(images, device)
        if images is not None:
            if not rows:
                images = self.inputs(images, device)
            elif self.augment is None:  # only the train loader's batches carry them
                raise ValueError("a batch with augmentation parameters for an evaluation's task")
            else:
                images = self.augment(images, rows[0], device, self.inputs)
        labels = None if labels is None else labels.to(device, non_blocking=True)
        if self.mixing is not None and key is not None:
            images = None if images is None else self.mixing.images(images, key)
            labels = None if labels is None else self.mixing.targets(labels, key, self.image_shape)
        return images, labels

    def criterion(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The training loss of logits against class indices or (mixed) soft targets; a pipeline's
        last stage computes it too."""
        # soft targets (label smoothing folded in): timm's SoftTargetCrossEntropy, in one call
        if target.dim() == 2:
            return F.cross_entropy(logits.float(), target)
        return F.cross_entropy(logits.float(), target, label_smoothing=self.label_smoothing)

    def loss(
        self,
        model: nn.Module,
        batch: Any,
        device: torch.device,
        autocast: AbstractContextManager,
        key: tuple[int, int] = (0, 0),
    ) -> torch.Tensor:
        images, target = self.prepare(batch, device, key if model.training else None)
        with autocast:
            logits = model(images)
        return self.criterion(logits, target)

    def evaluate(self, model: nn.Module, layout: Layout, autocast, run_dir: Path) -> dict[str, Any]:
        metrics: dict[str, Any] = evaluate_classification(
            model,
            self.data.val_loader,
            layout,
            autocast,
            len(self.data.classes),
            self.progress,
            self.inputs,
            lambda batches: self.feed(self.worker_decoded.naming(batches), layout.device),
        )
        if not self.top5:
            del metrics["val_top5"]
        if layout.is_main:  # per-class top-1 of the latest evaluation, by class name
            per_class = {
                name: {"top1": acc, "images": n, **confused_with(metrics, self.data.classes, i)}
                for i, (name, acc, n) in enumerate(
                    zip(self.data.classes, metrics["val_class_top1"], metrics["val_class_count"])
                )
            }
            (run_dir / "per_class.json").write_text(json.dumps(per_class, indent=1))
        return metrics

    def plots(self, m: dict[str, Any], run_dir: Path, title: str) -> list[Path]:
        """Top-1 per class of the latest evaluation, as bars; up to `CONFUSION_MAX_CLASSES`
        classes its confusion matrix."""
        values = dict(zip(self.data.classes, m.get("val_class_top1") or []))
        pngs = [
            plot_per_class(
                values,
                run_dir / "per_class_top1.png",
                f"{title}: top-1 per class{at_step(m)}",
                "val top-1 (%)",
            )
        ]
        if m.get("val_confusion"):
            pngs.append(
                plot_confusion(
                    m["val_confusion"],
                    list(self.data.classes),
                    run_dir / "confusion.png",
                    f"{title}: confusion{at_step(m)}",
                )
            )
        return [p for p in pngs if p is not None]

    # describe / summary / final_line show top-5 where the metrics hold it (`reports_top5`)
    @staticmethod
    def describe(m: dict[str, Any]) -> str:
        top5 = f" | top-5 {m['val_top5']:.2f}%" if "val_top5" in m else ""
        ema = f" | EMA top-1 {m['val_ema_top1']:.2f}%" if m.get("val_ema_top1") is not None else ""
        return (
            f"val loss {m['val_loss']:.4f} | top-1 {m['val_top1']:.2f}%{top5}{ema} | "
            f"{m['val_count']} images"
        )

    def summary(self, m: dict[str, Any]) -> dict[str, Any]:
        scored = [
            (a, name)
            for a, name in zip(m.get("val_class_top1", []), self.data.classes)
            if a is not None
        ]
        # the class to look at first (per_class.json and per_class_top1.png hold them all)
        worst = (
            {"val top-1, worst class (%)": round(min(scored)[0], 2), "worst class": min(scored)[1]}
            if scored
            else {}
        )
        ema = {"val top-1, EMA (%)": m["val_ema_top1"]} if m.get("val_ema_top1") is not None else {}
        top5 = {"val top-5 (%)": m["val_top5"]} if "val_top5" in m else {}
        return {
            "val loss": m["val_loss"],
            "val top-1 (%)": m["val_top1"],
            **top5,
            **worst,
            **ema,
            "val images": m["val_count"],
        }

    @staticmethod
    def final_line(m: dict[str, Any]) -> str:
        top5 = f"  top-5: {m['val_top5']:.2f}%" if "val_top5" in m else ""
        return f"val top-1: {m['val_top1']:.2f}%{top5}"
