"""The inputs on disk, checked in the launching process before any rank starts, each failure one
`ConfigError` naming the fix: `inputs.py` (the data root and its splits, the class count, the
weights, the trackers' packages), `images.py` (a tree's images: none missing from a class, a batch
to train on, every val image readable).

Imports: config, models, utils; data and synthetic where a check reads.
"""

from visiondist.preflight.images import check_images, check_val_readable, coco_categories
from visiondist.preflight.inputs import check_inputs, fetch_named_weights, infer_num_classes

__all__ = [
    "check_images",
    "check_inputs",
    "check_val_readable",
    "coco_categories",
    "fetch_named_weights",
    "infer_num_classes",
]
