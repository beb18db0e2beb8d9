"""How a rank scores a model: one module per kind of data set, each exact under any number of ranks.

- `classification.py`: top-1 / top-5 (top-5 reported above 10 classes), the val loss and per-class
  top-1 over ImageFolder-style splits (every sample counted once);
- `detection.py`: COCO box (and mask) mAP of a detector, every rank's detections gathered and scored
  once on rank 0 with COCOeval (12 stats each).

A new metric is a new module here that the task (`engine/classify_task.py`, `detect_task.py`)
calls; a scalar it reports also needs its name in `visiondist.models.EVAL_METRICS` (the metrics.csv
columns and the metrics `trainer.best_metric` may name). Imports: `data`, `parallel` and `observe`
(progress bars); never the trainer (tests/unit/test_layers.py).
"""
