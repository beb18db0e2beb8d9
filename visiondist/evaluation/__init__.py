"""How a rank scores a model: one module per kind of data set, each exact under any number of ranks.

- `classification.py`: top-1 / top-5 and the val loss over ImageFolder-style splits (every sample counted once);
- `coco.py`: COCO box mAP, every rank's detections gathered and scored once on rank 0 with COCOeval (12 stats).

A new metric is a new module here that the task (`visiondist.train.tasks`) calls. Imports: data, parallel, models and
`observe` (progress bars); never the trainer.
"""
