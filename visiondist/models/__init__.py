"""Model registry: `build_model(cfg.model)` turns a model config into a plain `nn.Module`.

Models hold no distributed code; each declares what `visiondist.parallel` needs of it (the ViT's TP plan and blocks:
`vit_parallel`), and `visiondist.parallel` transforms a finished model.

`build.py`: `build_model`, `build_deferred`, `TASKS`, `EVAL_METRICS`; families: `vit.py` (+ `vit_parallel.py`, its TP
plan and blocks), `detection.py` (torchvision's detectors, ViTDet), `detr.py` (transformers' DETR-class detectors);
`registry.py` (what each family supports), `init.py` (initial values, per rank), `weights.py` (pretrained files),
`flops.py` (training FLOPs for MFU), `sdpa.py` (which attention kernel runs).
"""

import importlib

# Imported on first use (PEP 562): the launcher reads `visiondist.models.registry` to plan a run, without torch's
# models, DTensor or torchvision. The ViT brings its TP plan and blocks (`vit_parallel`) wherever it is imported.
_MODULE_OF = {"EVAL_METRICS": "registry", "TASKS": "registry", "build_deferred": "build", "build_model": "build",
              "eval_metrics": "registry", "select_attention": "sdpa"}


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value


__all__ = ["EVAL_METRICS", "TASKS", "build_deferred", "build_model", "eval_metrics", "select_attention"]
