"""A rank's training parts, built once in the order that fails earliest: seeds, the task and its
data (a missing folder stops the run before a model is built), the val images checked, the laid-out
model, then the optimizer over this rank's shards, the EMA, the run's length, the LR schedule,
autocast and fp16's loss scaler. The training loop and its parts (`step.py`, `checkpointing.py`,
`validation.py`) take them as they are; they build nothing themselves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from visiondist.engine.build import (
    build_laid_out,
    check_val_images,
    num_params,
    run_length,
    run_of,
    seed_everything,
)
from visiondist.engine.ema import ModelEma
from visiondist.engine.optim import build_optimizer, build_scheduler
from visiondist.engine.precision import LossScaler, autocast_for, precision_name
from visiondist.engine.tasks import build_task
from visiondist.parallel import Layout, PipelinedViT, local_numel, unwrap

log = logging.getLogger(__name__)


@dataclass
class Components:
    task: Any  # `tasks.ClassificationTask` or `tasks.DetectionTask`: data, loss, evaluation, plots
    model: torch.nn.Module  # laid out: DDP / FSDP / TP / a pipeline stage
    optimizer: torch.optim.Optimizer  # over this rank's shards
    ema: Optional[ModelEma]
    scheduler: torch.optim.lr_scheduler.LRScheduler
    # a reusable context manager: autocast in trainer.precision on this device (or nothing)
    autocast: Any
    scaler: Optional[LossScaler]  # fp16 only
    total_steps: int
    length: str  # how the run's length was decided (for the start-up line)
    num_params: int  # the whole model's

    @property
    def data(self) -> Any:
        """The task's loaders, samplers and class names."""
        return self.task.data

    @property
    def pipeline(self) -> Optional[PipelinedViT]:
        """The model when it is a pipeline stage (it runs its own schedule), else None."""
        return self.model if isinstance(self.model, PipelinedViT) else None

    @property
    def rank_params(self) -> int:
        """The parameters this rank holds (its TP shards, its pipeline stage, its FSDP shard)."""
        return sum(local_numel(p) for p in self.model.parameters())


def build_components(
    cfg: DictConfig, layout: Layout, checkpoint: Optional[Path] = None
) -> Components:
    """Every part a rank trains with. `checkpoint`: the model's tensors are left for it to fill (no
    initial weights drawn or read), and the model is built as it saved it (`build_laid_out`)."""
    # every parallel switch is read from the resolved layout, never from cfg.parallel
    run_of(layout)
    t = cfg.trainer
    # the same on every rank: identical initial weights before any broadcast
    seed_everything(t.seed)
    # the data first: a missing folder stops the run before a model is built
    task = build_task(cfg, layout)
    check_val_images(task.data.val_loader)  # before step 1, not at the first evaluation
    # a pipeline's last stage
    model = build_laid_out(cfg, layout, getattr(task, "criterion", None), checkpoint)
    # over this rank's shards
    optimizer = build_optimizer(cfg.optim, unwrap(model), cfg.model.depth)
    # a default users of other trainers may not expect (timm's is none)
    if layout.is_main and t.clip_grad > 0:
        log.info(
            "gradients clipped to a global norm of %g (trainer.clip_grad; 0: not clipped)",
            t.clip_grad,
        )
    elif layout.is_main:
        log.info("gradients not clipped (trainer.clip_grad=0)")
    ema = ModelEma(unwrap(model), t.ema_decay) if t.ema_decay > 0 else None
    total_steps, length = run_length(t, task.data.train_sampler.steps_per_epoch)
    return Components(
        task=task,
        model=model,
        optimizer=optimizer,
        ema=ema,
        scheduler=build_scheduler(cfg.schedule, optimizer, total_steps),
        autocast=autocast_for(t.precision, layout.device),
        scaler=LossScaler(layout.device) if precision_name(t.precision) == "16" else None,
        total_steps=total_steps,
        length=length,
        num_params=num_params(cfg.model),
    )
