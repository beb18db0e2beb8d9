"""The entry points every rank runs: `train` (tools/train.py) and `evaluate_checkpoint` (tools/eval.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from visiondist.parallel import Layout

log = logging.getLogger(__name__)

# What a rank imports once started. The launcher imports this module for its entry points only, so these wait for
# the rank (about 1 s of torch.distributed, DTensor and albumentations a launch saves); the fork server of CPU ranks
# imports them once for all of them (visiondist.launch.spawn).
RANK_IMPORTS = ("visiondist.train.trainer", "visiondist.train.tasks", "visiondist.train.build",
                "visiondist.checkpoint.dcp", "visiondist.observe.summary", "visiondist.data.transforms")


def train(cfg: DictConfig, layout: Layout, run_dir: Path) -> dict[str, Any]:
    """Entry point of every rank: prepare the data once per node, then fit."""
    from visiondist.data.workers import close_loaders
    from visiondist.train.build import prepare_rank
    from visiondist.train.trainer import Trainer

    prepare_rank(cfg, layout, run_dir)
    trainer = Trainer(cfg, layout, run_dir)
    try:
        return trainer.fit()
    finally:
        close_loaders()  # while the trainer still holds its loaders: their workers are ended, not waited for


def evaluate_checkpoint(cfg: DictConfig, layout: Layout, run_dir: Path) -> dict[str, Any]:
    """Entry point of every rank of `tools/eval.py`: the model with `cfg.model.weights`, evaluated on the val split.
    Rank 0 prints the result (the 12-line COCOeval summary for detectors) and writes eval.json (and, for
    detectors, detections.json) into `run_dir` (by default `<output dir>/eval/<date>_<time>/`, with eval.log), and
    says where."""
    from visiondist.checkpoint.dcp import load_model_state
    from visiondist.data.workers import close_loaders
    from visiondist.observe.console import shown_path
    from visiondist.observe.summary import draw_evaluation
    from visiondist.parallel import unwrap
    from visiondist.train.build import build_laid_out, prepare_rank, seed_everything
    from visiondist.train.precision import autocast_for
    from visiondist.train.tasks import build_task
    from visiondist.utils.dcp import is_complete
    from visiondist.utils.heartbeat import PROGRESS

    prepare_rank(cfg, layout, run_dir, "eval.log")
    seed_everything(cfg.trainer.seed)
    PROGRESS.at("loading the weights")
    # a DCP checkpoint directory is read into whatever layout this run has; any other weights (a file, a DETR-class
    # detector's from_pretrained directory) are loaded as training's model.weights are
    checkpoint = Path(cfg.model.weights) if cfg.model.weights and is_complete(Path(cfg.model.weights)) else None
    model = build_laid_out(cfg, layout, checkpoint=checkpoint)  # a checkpoint fills the tensors itself
    if checkpoint is not None:
        load_model_state(checkpoint, unwrap(model), layout)
    task = build_task(cfg, layout, train=False)
    PROGRESS.at("evaluating")
    try:
        metrics = task.evaluate(unwrap(model), layout, autocast_for(cfg.trainer.precision, layout.device), run_dir)
    finally:
        close_loaders()  # while the task holds its loader: its workers are ended, not waited for
    if layout.is_main:
        decoded_by = task.decoded_by(layout.device)
        (run_dir / "eval.json").write_text(json.dumps({"weights": cfg.model.weights, "images decoded by": decoded_by,
                                                       **task.input_fields, **metrics}, indent=2))
        log.info("eval | %s | %simages decoded by %s", task.describe(metrics),
                 f"read {task.reads} | " if task.reads else "", decoded_by)
        pngs = draw_evaluation(task, metrics, run_dir, f"{cfg.model.name} on {cfg.data.name}") if cfg.trainer.plots \
            else []
        print(task.final_line(metrics), flush=True)
        written = ["eval.json", *(["detections.json"] if (run_dir / "detections.json").is_file() else []),
                   *(p.name for p in pngs), "eval.log"]
        print(f"eval dir: {shown_path(run_dir)} ({', '.join(written)})", flush=True)
    return metrics


evaluate_checkpoint.run_kind = "eval"  # type: ignore[attr-defined]  # its default run dir: <output dir>/eval/...
