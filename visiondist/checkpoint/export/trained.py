"""The model an export starts from: a run's trained weights in one process, unsharded, in eval mode,
on the CPU, with the class names and (detectors) COCO category ids its run recorded; and the example
inputs of its size."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import DictConfig
from torch import nn

from visiondist.checkpoint.dcp import load_model_state
from visiondist.checkpoint.export.images import detection_images
from visiondist.checkpoint.files import ema_wanted, read_trainer_state, resolve_checkpoint
from visiondist.config.compose import run_config
from visiondist.data.coco import CocoDetection
from visiondist.data.formats.exports import coco_paths
from visiondist.models import TASKS, build_deferred
from visiondist.models.detection import drop_fp32_hooks
from visiondist.models.init import is_meta, materialize
from visiondist.models.weights import load_local_weights
from visiondist.plan import check
from visiondist.utils.dcp import list_checkpoints

log = logging.getLogger(__name__)


@dataclass
class Trained:
    """The model an export starts from, with what its run recorded (`load_trained`).

    Args:
        cfg: the run's config.
        model: the model with its trained weights.
        source: the checkpoint directory or weights file they came from.
        step: the checkpoint's step; None for model.safetensors.
        classes: the class names, where known.
        categories: a detector's COCO category ids, where known.
    """

    cfg: DictConfig
    model: nn.Module  # eval mode, CPU, unsharded
    source: Path  # the checkpoint directory or weights file
    step: Optional[int]
    classes: Optional[list[str]]  # classifier: of logits 0..K-1; detector: of labels 1..K
    # detector: the COCO category id of labels 1..K, as the run recorded them
    categories: Optional[list[int]] = None
    ema: bool = False  # the checkpoint's EMA of the weights, not the model's own


def load_trained(run_dir: Path, step: Optional[int | str] = None, ema: bool = False) -> Trained:
    """The run's model with its trained weights: checkpoint `step` (default the latest; "best": the
    best kept by trainer.best_metric), else model.safetensors; with the class names and, for a
    detector, the COCO category ids the checkpoint records (else those of the run's annotation file,
    when it is here).

    Args:
        run_dir: the training run.
        step: a checkpoint's step number or "best"; None: the latest checkpoint (else
            model.safetensors).
        ema: the checkpoint's EMA of the weights (the run's `val_ema_*` model); ValueError where
            it holds none. A step="best" by an EMA metric reads the EMA whatever `ema` says.

    Returns:
        The `Trained` model, in eval mode on the CPU.
    """
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    check(cfg, mandatory=False)  # export reads no data
    torch.manual_seed(0)
    model, _ = build_deferred(cfg.model, weights=False)  # every tensor comes from the run's files
    if is_meta(model):
        materialize(model, "cpu", None)
    model.eval()
    # exported for fp32 inference: the bf16 box hooks have nothing to do
    if cfg.model.family != "vit":
        drop_fp32_hooks(model)
    ema, said = ema_wanted(run_dir, step, ema)
    if said:
        log.info(said)
    if step is not None or ema or list_checkpoints(run_dir):
        source = resolve_checkpoint(str(run_dir), step)
        load_model_state(source, model, ema=ema)
        state = read_trainer_state(source)
        trained = Trained(
            cfg,
            model,
            source,
            int(state["step"]),
            state.get("classes"),
            state.get("category_ids"),
            ema=ema,
        )
    else:
        source = run_dir / "model.safetensors"
        if not source.is_file():
            raise FileNotFoundError(
                f"{run_dir} has neither checkpoints nor model.safetensors: nothing to export"
            )
        load_local_weights(model, str(source))
        trained = Trained(cfg, model, source, None, None)
    if TASKS[cfg.model.family] == "detection" and trained.categories is None:
        trained.categories, names = coco_categories(cfg)
        trained.classes = trained.classes or names
    return trained


def coco_categories(cfg: DictConfig) -> tuple[Optional[list[int]], Optional[list[str]]]:
    """(the category id of labels 1..K, their names) as the COCO loader reads them from the run's
    val annotation file (for checkpoints that do not record them); (None, None), logged, when the
    file is not here."""
    try:
        images, ann_file = coco_paths(cfg.data, cfg.data.val_split)
        data = CocoDetection(images, ann_file, train=False)
    except (OSError, ValueError, KeyError) as exc:
        log.warning(
            "the checkpoint records no COCO category ids and the run's annotation file cannot be "
            "read (%s): the export carries no label -> category id map",
            exc,
        )
        return None, None
    return [data.cat_of[label] for label in range(1, len(data.classes) + 1)], list(data.classes)


def input_size(cfg: DictConfig) -> int:
    return int(cfg.model.img_size) if cfg.model.family == "vit" else int(cfg.model.max_size)


def example_images(cfg: DictConfig, batch: int = 2) -> torch.Tensor:
    """`batch` random images of the model's input size (the same ones each call)."""
    size = input_size(cfg)
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def detector_examples(
    cfg: DictConfig, limit: int
) -> tuple[list[tuple[str, torch.Tensor]], Optional[str]]:
    """What a detector's exported file is checked on: up to `limit` val images that hold objects
    (`images.detection_images`, and where they come from), else one random image of the input size
    where the data is not on this machine."""
    examples, source = detection_images(cfg, cfg.data.val_split, limit)
    return examples or [("a random image", example_images(cfg, 1)[0])], source


# what `logits_difference` compares, for the check lines
LOGITS_COMPARED = "logits of 1 and 3 random images compared"


def logits_difference(trained: Trained, exported: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """The largest absolute difference between an exported classifier's logits and the PyTorch
    model's on random images at batches 1 and 3 (exports are traced at 2: both must be taken)."""
    size = example_images(trained.cfg).shape[1:]
    generator = torch.Generator().manual_seed(1)
    diff = 0.0
    with torch.no_grad():
        for batch in (1, 3):
            images = torch.randn(batch, *size, generator=generator)
            diff = max(diff, float((exported(images) - trained.model(images)).abs().max()))
    return diff
