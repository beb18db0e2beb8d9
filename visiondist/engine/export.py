"""Export a trained run: one consolidated file that the model's own library loads without visiondist.

- `safetensors`: the unsharded weights under the anchor library's key names (timm's for ViTs: fused `qkv`;
  torchvision's for torchvision detectors) plus `<out>.json`, a sidecar saying how to build the model that loads
  them (`create` / `builder` + `kwargs`), the input size, the normalisation and the class names; a detector's also
  `labels`, the COCO category id and name of each label it predicts. The file's own metadata holds the names too.
- `onnx` (`visiondist.engine.export_onnx`): the eval-mode model (classifier: images -> logits with a dynamic batch;
  torchvision detector: one image -> boxes, labels, scores), the names in its metadata, checked against PyTorch with
  ONNX Runtime when it is installed.
- `torchscript`: traced (classifiers) or scripted (torchvision detectors).

Weights come from a run's checkpoint (any parallel layout; DCP reads the shards into this one process) or, for a run
without checkpoints, its `model.safetensors`.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from visiondist.engine.checkpoint import list_checkpoints, load_model_state, read_trainer_state, resolve_checkpoint
from visiondist.engine.export_onnx import check_onnx, example_images, input_size, write_onnx
from visiondist.models import TASKS, build_deferred
from visiondist.models.init import is_meta, materialize
from visiondist.models.vit import to_timm_state_dict
from visiondist.models.weights import load_local_weights, save_weights

log = logging.getLogger(__name__)

__all__ = ["FORMATS", "Trained", "check_onnx", "coco_categories", "export", "export_state_dict", "label_map",
           "load_trained", "name_metadata", "sidecar", "timm_data_config"]  # check_onnx: export_onnx's, for callers

FORMATS = ("safetensors", "onnx", "torchscript")


@dataclass
class Trained:
    cfg: DictConfig
    model: nn.Module  # eval mode, CPU, unsharded
    source: Path  # the checkpoint directory or weights file
    step: Optional[int]
    classes: Optional[list[str]]  # classifier: of logits 0..K-1; detector: of labels 1..K
    categories: Optional[list[int]] = None  # detector: the COCO category id of labels 1..K, as the run recorded them


def load_trained(run_dir: Path, step: "Optional[int | str]" = None) -> Trained:
    """The run's model with its trained weights: checkpoint `step` (default the latest; "best": the best kept by
    trainer.best_metric), else model.safetensors; with the class names and, for a detector, the COCO category ids
    the checkpoint records (else those of the run's annotation file, when it is here)."""
    from visiondist.config.compose import run_config
    from visiondist.plan import check

    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    check(cfg, mandatory=False)  # export reads no data
    torch.manual_seed(0)
    model, _ = build_deferred(cfg.model, weights=False)  # every tensor comes from the run's files
    if is_meta(model):
        materialize(model, "cpu", None)
    model.eval()
    if cfg.model.family != "vit":  # exported for fp32 inference: the bf16 box hooks have nothing to do
        from visiondist.models.detection import drop_fp32_hooks

        drop_fp32_hooks(model)
    if step is not None or list_checkpoints(run_dir):
        source = resolve_checkpoint(str(run_dir), step)
        load_model_state(source, model)
        state = read_trainer_state(source)
        trained = Trained(cfg, model, source, int(state["step"]), state.get("classes"), state.get("category_ids"))
    else:
        source = run_dir / "model.safetensors"
        if not source.is_file():
            raise FileNotFoundError(f"{run_dir} has neither checkpoints nor model.safetensors: nothing to export")
        load_local_weights(model, str(source))
        trained = Trained(cfg, model, source, None, None)
    if TASKS[cfg.model.family] == "detection" and trained.categories is None:
        trained.categories, names = coco_categories(cfg)
        trained.classes = trained.classes or names
    return trained


def coco_categories(cfg: DictConfig) -> tuple[Optional[list[int]], Optional[list[str]]]:
    """(the category id of labels 1..K, their names) as the COCO loader reads them from the run's val annotation
    file (for checkpoints that do not record them); (None, None), logged, when the file is not here."""
    from visiondist.data import coco_paths
    from visiondist.data.coco import CocoDetection

    try:
        data = CocoDetection(*coco_paths(cfg.data, cfg.data.val_split), train=False)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("the checkpoint records no COCO category ids and the run's annotation file cannot be read "
                    "(%s): the export carries no label -> category id map", exc)
        return None, None
    return [data.cat_of[label] for label in range(1, len(data.classes) + 1)], list(data.classes)


def label_map(trained: Trained) -> Optional[dict[str, dict[str, Any]]]:
    """A detector's labels: {"<k>": {"category_id": the annotation file's category id, "name": its name}} for each
    label k = 1..K the model predicts (0 is the background); the COCO loader numbers the annotation file's category
    ids in increasing order. None for classifiers and for runs whose category ids are unknown."""
    if TASKS[trained.cfg.model.family] != "detection" or trained.categories is None:
        return None
    names = trained.classes or [None] * len(trained.categories)
    return {str(label): {"category_id": int(cat), "name": name}
            for label, (cat, name) in enumerate(zip(trained.categories, names), start=1)}


def name_metadata(trained: Trained) -> dict[str, str]:
    """What the exported file's own metadata says of the model's outputs (JSON text): "classes", the names of a
    classifier's logits in order; "labels", a detector's `label_map`."""
    if TASKS[trained.cfg.model.family] == "detection":
        labels = label_map(trained)
        return {} if labels is None else {"labels": json.dumps(labels)}
    if not trained.classes:
        log.warning("the run records no class names (exported from %s): the file's metadata names no classes",
                    trained.source)
        return {}
    return {"classes": json.dumps(list(trained.classes))}


def timm_data_config(trained: Trained) -> dict[str, Any]:
    """The run's eval preprocessing as entries of timm's `pretrained_cfg` (`create["pretrained_cfg_overlay"]`): what
    `timm.data.resolve_model_data_config(model)` reads (input size, interpolation, crop, mean / std; the test-time
    ones equal to them), plus the head's size and the class names."""
    cfg, size = trained.cfg, int(trained.cfg.model.img_size)
    crop_pct = float(cfg.data.crop_pct)
    overlay: dict[str, Any] = {
        "input_size": [3, size, size], "test_input_size": [3, size, size], "fixed_input_size": True,
        "interpolation": str(cfg.data.get("interpolation", "bilinear")), "crop_pct": crop_pct,
        "test_crop_pct": crop_pct, "crop_mode": "center",
        "mean": [float(v) for v in cfg.data.mean], "std": [float(v) for v in cfg.data.std],
        "num_classes": int(cfg.model.num_classes)}
    if trained.classes:
        overlay["label_names"] = list(trained.classes)
    return overlay


def sidecar(trained: Trained) -> dict[str, Any]:
    """How to rebuild the model that loads the exported weights, and what its inputs are (how the run decoded its
    images included)."""
    from visiondist.data.decode import POLICY

    cfg, m = trained.cfg, trained.cfg.model
    info: dict[str, Any] = {
        "model": m.name,
        "task": TASKS[m.family],
        "num_classes": int(m.num_classes),
        "classes": trained.classes,
        "input_size": input_size(cfg),
        "mean": list(cfg.data.mean),
        "std": list(cfg.data.std),
        "decode": dict(POLICY),
        "source": {"path": str(trained.source), "step": trained.step},
    }
    labels = label_map(trained)
    if labels is not None:  # detectors: label k -> the annotation file's category id and name
        info["labels"] = labels
    if m.family == "vit":
        info.update(interpolation=str(cfg.data.get("interpolation", "bilinear")), crop_pct=float(cfg.data.crop_pct))
        create = {"model_name": m.timm_name or "vit_base_patch16_224", "num_classes": int(m.num_classes),
                  "img_size": int(m.img_size), "patch_size": int(m.patch_size), "embed_dim": int(m.embed_dim),
                  "depth": int(m.depth), "num_heads": int(m.num_heads), "mlp_ratio": float(m.mlp_ratio),
                  "qkv_bias": bool(m.qkv_bias),
                  # timm.data.resolve_model_data_config(model) then gives the run's preprocessing, not timm's
                  # defaults for model_name (224 px, its mean / std and crop)
                  "pretrained_cfg_overlay": timm_data_config(trained)}
        info.update(library="timm", create=create,
                    usage="model = timm.create_model(**create, pretrained=False); model.load_state_dict("
                          "safetensors.torch.load_file(path), strict=True); the run's eval preprocessing: "
                          "timm.data.create_transform(**timm.data.resolve_model_data_config(model))")
    elif m.family == "torchvision":
        kwargs = {"weights": None, "weights_backbone": None, "num_classes": int(m.num_classes) + 1,
                  "min_size": int(m.min_size), "max_size": int(m.max_size),
                  **OmegaConf.to_container(m.kwargs, resolve=True)}
        info.update(library="torchvision", builder=f"torchvision.models.detection.{m.arch}", kwargs=kwargs,
                    usage="builder(**kwargs).load_state_dict(safetensors.torch.load_file(path), strict=True); "
                          "labels are 1..num_classes (0 is the background); labels[str(k)] holds label k's COCO "
                          "category_id and name")
        if float(m.anchor_scale) != 1.0 or m.roi_sampling_ratio is not None:
            info["not_in_kwargs"] = {
                "anchor_scale": float(m.anchor_scale), "roi_sampling_ratio": m.roi_sampling_ratio,
                "note": "the weights load unchanged; to reproduce the outputs exactly, scale the builder's anchor "
                        "sizes (rpn_anchor_generator) and set box_roi_pool's sampling_ratio likewise"}
    else:
        info.update(library="visiondist", usage="visiondist.models.build_model(config.model), then load_state_dict; "
                                                "no other library has this architecture")
    return info


def export_state_dict(trained: Trained) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu().contiguous() for k, v in trained.model.state_dict().items()}
    return to_timm_state_dict(state) if trained.cfg.model.family == "vit" else state


def export(trained: Trained, fmt: str, out: Path) -> list[Path]:
    """Write the export; returns the files written (each to a temporary name, then renamed)."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    written = [out]
    if fmt == "safetensors":
        save_weights(export_state_dict(trained), tmp, metadata={"format": "pt", **name_metadata(trained)})
        meta = out.with_suffix(".json")
        meta.write_text(json.dumps(sidecar(trained), indent=2))
        written.append(meta)
    elif fmt == "onnx":
        write_onnx(trained, tmp, name_metadata(trained))
    else:
        _export_torchscript(trained, tmp)
    tmp.replace(out)
    return written


def _export_torchscript(trained: Trained, path: Path) -> None:
    model, family = trained.model, trained.cfg.model.family
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the input-size check is constant for the trace
        scripted = torch.jit.trace(model, example_images(trained.cfg)) if family == "vit" else torch.jit.script(model)
    torch.jit.save(scripted, str(path))
