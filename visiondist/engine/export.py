"""Export a trained run: one consolidated file that the model's own library loads without visiondist.

- `safetensors`: the unsharded weights under the anchor library's key names (timm's for ViTs: fused `qkv`;
  torchvision's for torchvision detectors) plus `<out>.json`, a sidecar saying how to build the model that loads
  them (`create` / `builder` + `kwargs`), the input size, the normalisation and the class names.
- `onnx`: the eval-mode model (classifier: images -> logits with a dynamic batch; torchvision detector: one image ->
  boxes, labels, scores), checked against PyTorch with ONNX Runtime when it is installed.
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
from visiondist.models import TASKS, build_deferred
from visiondist.models.init import is_meta, materialize
from visiondist.models.vit import to_timm_state_dict
from visiondist.models.weights import load_local_weights, save_weights

log = logging.getLogger(__name__)

FORMATS = ("safetensors", "onnx", "torchscript")


@dataclass
class Trained:
    cfg: DictConfig
    model: nn.Module  # eval mode, CPU, unsharded
    source: Path  # the checkpoint directory or weights file
    step: Optional[int]
    classes: Optional[list[str]]


def load_trained(run_dir: Path, step: Optional[int] = None) -> Trained:
    """The run's model with its trained weights: checkpoint `step` (default the latest), else model.safetensors."""
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
        return Trained(cfg, model, source, int(state["step"]), state.get("classes"))
    source = run_dir / "model.safetensors"
    if not source.is_file():
        raise FileNotFoundError(f"{run_dir} has neither checkpoints nor model.safetensors: nothing to export")
    load_local_weights(model, str(source))
    return Trained(cfg, model, source, None, None)


def _input_size(cfg: DictConfig) -> int:
    return int(cfg.model.img_size) if cfg.model.family == "vit" else int(cfg.model.max_size)


def sidecar(trained: Trained) -> dict[str, Any]:
    """How to rebuild the model that loads the exported weights, and what its inputs are."""
    cfg, m = trained.cfg, trained.cfg.model
    info: dict[str, Any] = {
        "model": m.name,
        "task": TASKS[m.family],
        "num_classes": int(m.num_classes),
        "classes": trained.classes,
        "input_size": _input_size(cfg),
        "mean": list(cfg.data.mean),
        "std": list(cfg.data.std),
        "source": {"path": str(trained.source), "step": trained.step},
    }
    if m.family == "vit":
        create = {"model_name": m.timm_name or "vit_base_patch16_224", "num_classes": int(m.num_classes),
                  "img_size": int(m.img_size), "patch_size": int(m.patch_size), "embed_dim": int(m.embed_dim),
                  "depth": int(m.depth), "num_heads": int(m.num_heads), "mlp_ratio": float(m.mlp_ratio),
                  "qkv_bias": bool(m.qkv_bias)}
        info.update(library="timm", create=create,
                    usage="timm.create_model(**create, pretrained=False).load_state_dict("
                          "safetensors.torch.load_file(path), strict=True)")
    elif m.family == "torchvision":
        kwargs = {"weights": None, "weights_backbone": None, "num_classes": int(m.num_classes) + 1,
                  "min_size": int(m.min_size), "max_size": int(m.max_size),
                  **OmegaConf.to_container(m.kwargs, resolve=True)}
        info.update(library="torchvision", builder=f"torchvision.models.detection.{m.arch}", kwargs=kwargs,
                    usage="builder(**kwargs).load_state_dict(safetensors.torch.load_file(path), strict=True); "
                          "labels are 1..num_classes (0 is the background)")
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


def _example(trained: Trained, batch: int = 2) -> torch.Tensor:
    size = _input_size(trained.cfg)
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def export(trained: Trained, fmt: str, out: Path) -> list[Path]:
    """Write the export; returns the files written (each to a temporary name, then renamed)."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    written = [out]
    if fmt == "safetensors":
        save_weights(export_state_dict(trained), tmp, metadata={"format": "pt"})
        meta = out.with_suffix(".json")
        meta.write_text(json.dumps(sidecar(trained), indent=2))
        written.append(meta)
    elif fmt == "onnx":
        _export_onnx(trained, tmp)
    else:
        _export_torchscript(trained, tmp)
    tmp.replace(out)
    return written


def _export_onnx(trained: Trained, path: Path) -> None:
    model, family = trained.model, trained.cfg.model.family
    if family == "vit":
        batch = torch.export.Dim("batch", min=1, max=4096)
        program = torch.onnx.export(model, (_example(trained),), dynamo=True, input_names=["images"],
                                    output_names=["logits"], dynamic_shapes={"x": {0: batch}}, external_data=False)
        program.save(str(path))
    elif family == "torchvision":
        # torchvision's detectors support the TorchScript-based exporter (opset >= 11), one image per call
        torch.onnx.export(model, ([_example(trained, 1)[0]],), str(path), dynamo=False, opset_version=17,
                          input_names=["image"], output_names=["boxes", "labels", "scores"],
                          dynamic_axes={"image": {1: "height", 2: "width"}, "boxes": {0: "detections"},
                                        "labels": {0: "detections"},
                                        "scores": {0: "detections"}})
    else:
        raise ValueError(f"format=onnx is not supported for model.family={family}: export format=safetensors")


def _export_torchscript(trained: Trained, path: Path) -> None:
    model, family = trained.model, trained.cfg.model.family
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # the input-size check is constant for the trace
        scripted = torch.jit.trace(model, _example(trained)) if family == "vit" else torch.jit.script(model)
    torch.jit.save(scripted, str(path))


def check_onnx(trained: Trained, path: Path) -> Optional[float]:
    """Largest |ONNX Runtime - PyTorch| on an example input; None when onnxruntime is not installed."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    if trained.cfg.model.family == "vit":
        x = _example(trained)
        with torch.no_grad():
            ref = [trained.model(x)]
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    else:
        x = _example(trained, 1)[0]
        with torch.no_grad():
            out = trained.model([x])[0]
        ref = [out["boxes"], out["labels"], out["scores"]]
        got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    diffs = []
    for r, g in zip(ref, got):
        g = torch.from_numpy(g)
        if r.shape != g.shape:
            return float("inf")
        diffs.append(float((r.double() - g.double()).abs().max()) if r.numel() else 0.0)
    return max(diffs)
