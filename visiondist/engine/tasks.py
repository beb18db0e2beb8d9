"""What differs between training a classifier and a detector: the data, the loss of a batch, the
evaluation and how its result is reported, each family's in a task (`engine/classify_task.py`,
`engine/detect_task.py`). The trainer holds one task and never branches on which."""

from __future__ import annotations

from omegaconf import DictConfig

from visiondist.engine.classify_task import ClassificationTask
from visiondist.engine.detect_task import DetectionTask
from visiondist.models import TASKS
from visiondist.parallel import Layout

__all__ = ["ClassificationTask", "DetectionTask", "build_task"]


def build_task(cfg: DictConfig, layout: Layout, train: bool = True):
    """The task of the model's family; `train=False` reads only what evaluation needs."""
    task = {"classification": ClassificationTask, "detection": DetectionTask}[
        TASKS[cfg.model.family]
    ]
    return task(cfg, layout, train)
