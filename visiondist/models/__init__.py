"""Model registry: `build_model(cfg.model)` turns a model config into a plain `nn.Module`.

Models hold no distributed code; each declares what `visiondist.parallel` needs of it (the ViT's TP
plan and blocks: `vit_parallel`), and `visiondist.parallel` transforms a finished model.

`build.py`: `build_model`, `build_deferred`, `TASKS`, `EVAL_METRICS`; families: `vit.py` (+
`vit_parallel.py`, its TP plan and blocks; `patches.py`, its native-resolution patch sequences),
`detection.py` (torchvision's detectors, ViTDet), `detr.py` (transformers' DETR-class detectors);
`registry.py` (what each family supports), `shape.py` (a ViT's shape as numbers, what the planner
counts), `init.py` (initial values, per rank), `weights.py` (pretrained files), `weights_check.py`
(a weights file checked against the model a config builds, before any rank starts; a ViT's shape
read off a file in `vit_weights.py`), `flops.py`
(training FLOPs per image: counted for MFU, analytic for the planner), `sdpa.py` (which attention
kernel runs).

Imports: `compat`, `utils`, `config` and `parallel` (what a model declares to it); never the planner
(`visiondist.plan`).
"""

from visiondist.utils.lazy import lazy_exports

# Imported on first use: the launcher reads `visiondist.models.registry` to plan a run, without
# torch's models, DTensor or torchvision. The ViT brings its TP plan and blocks (`vit_parallel`)
# wherever it is imported.
__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "registry": ("EVAL_METRICS", "TASKS", "eval_metrics", "padded_batches"),
        "build": ("build_deferred", "build_model"),
        "sdpa": ("select_attention",),
    },
)
