"""Model registry: `build_model(cfg.model)` turns a model config into a plain `nn.Module`.

Models hold no distributed code; each declares what `visiondist.parallel` needs of it (the ViT's TP plan and blocks:
`vit_parallel`), and `visiondist.parallel` transforms a finished model.

`build.py`: `build_model`, `build_deferred`, `TASKS`, `EVAL_METRICS`; families: `vit.py` (+ `vit_parallel.py`, its TP
plan and blocks), `detection.py` (torchvision's detectors, ViTDet), `detr.py` (transformers' DETR-class detectors);
`registry.py` (what each family supports), `init.py` (initial values, per rank), `weights.py` (pretrained files),
`flops.py` (training FLOPs for MFU), `sdpa.py` (which attention kernel runs).
"""

from visiondist.models import vit_parallel  # noqa: F401 (registers the ViT's TP plan and blocks with visiondist.parallel)
from visiondist.models.build import EVAL_METRICS, TASKS, build_deferred, build_model, eval_metrics
from visiondist.models.sdpa import select_attention

__all__ = ["EVAL_METRICS", "TASKS", "build_deferred", "build_model", "eval_metrics", "select_attention"]
