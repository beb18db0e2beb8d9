"""The entry points every rank runs: `train` (tools/train.py) and `evaluate_checkpoint`
(tools/eval.py).

The launcher imports this module for its entry points only: what a rank needs (the trainer's parts,
torch.distributed, DTensor, DCP, the data and the models: about 1 s; the run's report and its rich
console: 30 ms) is imported in the functions (`# noqa: PLC0415 (rank-side)`); what is light is
imported here."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from visiondist.engine.precision import autocast_for
from visiondist.engine.state import LoopState
from visiondist.faults.failures import set_aside_recovered
from visiondist.models.exported import runtime_of
from visiondist.observe.metrics import MetricsLogger
from visiondist.utils.dcp import is_complete
from visiondist.utils.heartbeat import PROGRESS
from visiondist.utils.signals import STOP

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch import nn

    from visiondist.engine.trainer import Hook, Trainer
    from visiondist.parallel import Layout

log = logging.getLogger(__name__)

# what a rank says of a stop a callback asked for on another rank
ELSEWHERE = "a callback on another rank"

# What a rank imports once started. The launcher imports this module for its entry points only, so
# these wait for the rank (about 1 s of torch.distributed, DTensor and albumentations a launch
# saves); the fork server of CPU ranks imports them once for all of them (visiondist.launch.spawn).
RANK_IMPORTS = (
    "visiondist.engine.trainer",
    "visiondist.engine.hooks",
    "visiondist.engine.announce",
    "visiondist.engine.summary",
    "visiondist.engine.tasks",
    "visiondist.engine.build",
    "visiondist.checkpoint.dcp",
    "visiondist.observe.summary",
    "visiondist.data.transforms",
)


def build_trainer(
    cfg: DictConfig, layout: Layout, run_dir: Path, hooks: Optional[Sequence[Hook]] = None
) -> Trainer:
    """Build a rank's training loop, ready to run.

    A rank's training loop with everything it holds: the parts (with no initial weights when a
    checkpoint is to fill every tensor), the checkpoint resumed, the loop state it starts from, the
    optimizer step, the checkpoints, the evaluation, the metrics and `hooks` (default:
    `hooks.default_hooks`).

    Args:
        cfg: the run's resolved config (read-only), as every rank gets it.
        layout: this rank's place in the device mesh, carrying the resolved `RunLayout`.
        run_dir: the run directory: checkpoints, metrics and logs go there, and a checkpoint there
            is resumed.
        hooks: the loop's hooks in the order they run; None: `hooks.default_hooks()`.

    Returns:
        The `Trainer`, not yet started (`run_trainer` runs it).
    """
    from visiondist.engine.checkpointing import (  # noqa: PLC0415 (rank-side)
        Checkpointing,
        resume,
        resume_path,
    )
    from visiondist.engine.components import build_components  # noqa: PLC0415 (rank-side)
    from visiondist.engine.hooks import default_hooks  # noqa: PLC0415 (rank-side)
    from visiondist.engine.step import OptimizerStep  # noqa: PLC0415 (rank-side)
    from visiondist.engine.trainer import Trainer  # noqa: PLC0415 (rank-side)
    from visiondist.engine.utilisation import Utilisation  # noqa: PLC0415 (rank-side)
    from visiondist.engine.validation import Validation  # noqa: PLC0415 (rank-side)

    checkpoint = resume_path(cfg, run_dir)
    parts = build_components(cfg, layout, checkpoint=checkpoint)
    resumed = resume(cfg, layout, run_dir, parts, checkpoint)
    state = LoopState.starting_from(resumed, parts.data.train_sampler.steps_per_epoch)
    t = cfg.trainer
    metrics = MetricsLogger(
        run_dir,
        layout.is_main,
        t.loggers,
        parts.task.columns,
        continue_from=state.step if resumed.same_run(run_dir) else None,
    )
    optimizer_step = OptimizerStep(cfg, layout, parts, state)
    return Trainer(
        cfg,
        layout,
        run_dir,
        parts,
        state,
        optimizer_step,
        Checkpointing(cfg, layout, run_dir, parts, state, settle=optimizer_step.settle),
        Validation(layout, run_dir, parts, state, metrics),
        metrics,
        Utilisation(cfg, layout),
        list(default_hooks() if hooks is None else hooks),
    )


def run_trainer(trainer: Trainer) -> dict[str, Any]:
    """Run a built trainer to its end and report the run.

    The trainer's run from its start-up lines to its report: rank 0's experiment trackers
    (`trainer.loggers`) run for its duration and end as it does (finished, stopped or failed).
    Returns the summary of a complete run, or where a stopped one stopped.

    Args:
        trainer: the loop, as `build_trainer` makes it.

    Returns:
        The run's summary (what summary.json holds); for a run that stopped early, `"stopped at
        step"` and `"run dir"` (and `"stopped by"`, the signal).
    """
    from visiondist.engine.announce import announce  # noqa: PLC0415 (rank-side)
    from visiondist.engine.summary import run_summary  # noqa: PLC0415 (rank-side)
    from visiondist.observe.console import shown_path  # noqa: PLC0415 (rank-side)
    from visiondist.observe.summary import report_run  # noqa: PLC0415 (rank-side)

    cfg, state, metrics = trainer.cfg, trainer.state, trainer.metrics
    try:
        metrics.start_trackers(cfg)
        announce(trainer)
        complete = trainer.train()
    except BaseException:
        metrics.close("failed")  # no tracker run (or its process) outlives a failed rank 0
        raise
    if not complete:
        total = trainer.parts.total_steps
        if state.stop_requested:
            why = f"{STOP.received or 'a signal to another rank'}"
        elif state.stop_asked:
            why = state.stop_asked_here or f"{ELSEWHERE} asked to stop"
        else:
            why = "trainer.stop_at_step"
        # the launcher says how to go on
        log.info("stopped after step %d of %d (%s)", state.step, total, why)
        metrics.close("stopped")
        return {
            "stopped at step": state.step,
            "run dir": str(trainer.run_dir),
            **({"stopped by": STOP.received or "SIGTERM"} if state.stop_requested else {}),
            **({"stopped because": why} if state.stop_asked and not state.stop_requested else {}),
        }
    assert state.timer is not None
    summary = run_summary(trainer, state.timer.total_seconds)
    if trainer.layout.is_main:  # failures a restart recovered from: kept aside, said
        for failure in set_aside_recovered(trainer.run_dir):
            log.info("recovered from: %s (%s)", failure.line, shown_path(failure.file))

    # the trackers get the plots and the weights, then end their runs
    def written(pngs: list[Path]) -> None:
        metrics.log_files(pngs, state.weights, state.step)
        metrics.close()

    if trainer.layout.is_main:
        t, run = cfg.trainer, trainer.layout.run  # twice the length that ended the run
        longer = (
            f"trainer.max_steps={2 * t.max_steps}"
            if trainer.parts.length.startswith("trainer.max_steps")
            else f"trainer.max_epochs={2 * t.max_epochs}"
        )
        report_run(
            trainer.run_dir,
            summary,
            metrics.rows,
            trainer.parts.task,
            state.last_eval,
            _title(cfg),
            written,
            t.plots,
            longer,
            under_torchrun=bool(run is not None and run.under_torchrun),
        )
    metrics.close()
    return summary


def train(
    cfg: DictConfig, layout: Layout, run_dir: Path, callbacks: Sequence[Any] = ()
) -> dict[str, Any]:
    """Train on this rank: tools/train.py's entry point, which `visiondist.launch.launch` runs.

    Entry point of every rank: prepare the data once per node, then build the trainer and run
    it.

    Args:
        cfg: the run's resolved config (read-only).
        layout: this rank's place in the device mesh, carrying the resolved `RunLayout`.
        run_dir: the run directory (created by the launcher).
        callbacks: a user's callbacks (`hooks.callbacks`), run after the default hooks.

    Returns:
        What `run_trainer` returns: the run's summary, or where a stopped run stopped.
    """
    from visiondist.data.workers import close_loaders  # noqa: PLC0415 (rank-side)
    from visiondist.engine.build import prepare_rank  # noqa: PLC0415 (rank-side)
    from visiondist.engine.hooks import default_hooks  # noqa: PLC0415 (rank-side)
    from visiondist.engine.hooks.callbacks import CallbackHook  # noqa: PLC0415 (rank-side)

    prepare_rank(cfg, layout, run_dir)
    hooks = [*default_hooks(), CallbackHook(callbacks)] if callbacks else None
    trainer = build_trainer(cfg, layout, run_dir, hooks)
    try:
        return run_trainer(trainer)
    finally:
        # while the trainer still holds its loaders: their workers are ended, not waited for
        close_loaders()


def evaluate_checkpoint(cfg: DictConfig, layout: Layout, run_dir: Path) -> dict[str, Any]:
    """Evaluate a model's weights on the val split: tools/eval.py's entry point.

    Entry point of every rank of `tools/eval.py`: the model with `cfg.model.weights`, evaluated
    on the val split. Rank 0 prints the result (the 12-line COCOeval summary for detectors) and
    writes eval.json (and, for detectors, detections.json) into `run_dir` (by default `<output
    dir>/eval/<date>_<time>/`, with eval.log), and says where.

    Args:
        cfg: the evaluation's resolved config; `cfg.model.weights` names the weights (a DCP
            checkpoint directory, a weights file or a from_pretrained directory).
        layout: this rank's place in the device mesh, carrying the resolved `RunLayout`.
        run_dir: where eval.json, eval.log and the plots go.

    Returns:
        The evaluation's metrics (the task's `val_*` figures).
    """
    from visiondist.checkpoint.dcp import load_model_state  # noqa: PLC0415 (rank-side)
    from visiondist.data.workers import close_loaders  # noqa: PLC0415 (rank-side)
    from visiondist.engine.build import (  # noqa: PLC0415 (rank-side)
        build_laid_out,
        prepare_rank,
        seed_everything,
    )
    from visiondist.engine.tasks import build_task  # noqa: PLC0415 (rank-side)
    from visiondist.observe.console import shown_path  # noqa: PLC0415 (rank-side)
    from visiondist.observe.summary import draw_evaluation  # noqa: PLC0415 (rank-side)
    from visiondist.parallel import unwrap  # noqa: PLC0415 (rank-side)

    prepare_rank(cfg, layout, run_dir, "eval.log")
    seed_everything(cfg.trainer.seed)
    PROGRESS.at("loading the weights")
    # a DCP checkpoint directory is read into whatever layout this run has; any other weights (a
    # file, a DETR-class detector's from_pretrained directory) are loaded as training's
    # model.weights are
    checkpoint = (
        Path(cfg.model.weights)
        if cfg.model.weights and is_complete(Path(cfg.model.weights))
        else None
    )
    exported = Path(cfg.model.weights) if cfg.model.weights else None
    model: nn.Module
    if exported is not None and runtime_of(exported):  # an exported file, run by its runtime
        from visiondist.checkpoint.export.runtimes import load_runtime  # noqa: PLC0415

        model = load_runtime(cfg.model, exported, layout.device)
        if layout.is_main:
            log.info("evaluating %s, run by %s", exported, model.runtime)
    else:
        # a checkpoint fills the tensors itself
        model = build_laid_out(cfg, layout, checkpoint=checkpoint)
    ema = checkpoint is not None and bool(cfg.model.get("weights_ema", False))
    if checkpoint is not None:
        load_model_state(checkpoint, unwrap(model), layout, ema=ema)
    task = build_task(cfg, layout, train=False)
    PROGRESS.at("evaluating")
    try:
        metrics = task.evaluate(
            unwrap(model), layout, autocast_for(cfg.trainer.precision, layout.device), run_dir
        )
    finally:
        close_loaders()  # while the task holds its loader: its workers are ended, not waited for
    if layout.is_main:
        decoded_by = task.decoded_by(layout.device)
        (run_dir / "eval.json").write_text(
            json.dumps(
                {
                    "weights": cfg.model.weights,
                    **({"ema": "the checkpoint's EMA of the weights"} if ema else {}),
                    **({"run by": model.runtime} if hasattr(model, "runtime") else {}),
                    "images decoded by": decoded_by,
                    **task.input_fields,
                    **metrics,
                    # val_confusion's and val_class_top1's rows and columns, by name
                    **({"classes": list(task.data.classes)} if "val_confusion" in metrics else {}),
                },
                indent=2,
            )
        )
        log.info(
            "eval | %s | %simages decoded by %s",
            task.describe(metrics),
            f"read {task.reads} | " if task.reads else "",
            decoded_by,
        )
        pngs = draw_evaluation(task, metrics, run_dir, _title(cfg)) if cfg.trainer.plots else []
        print(task.final_line(metrics), flush=True)
        written = [
            "eval.json",
            *(
                name
                for name in ("per_class.json", "detections.json", "segmentations.json")
                if (run_dir / name).is_file()
            ),
            *(p.name for p in pngs),
            "eval.log",
        ]
        print(f"eval dir: {shown_path(run_dir)} ({', '.join(written)})", flush=True)
    return metrics


evaluate_checkpoint.run_kind = "eval"  # type: ignore[attr-defined]  # its default run dir: <output dir>/eval/...


def _title(cfg: DictConfig) -> str:
    """The plots' title: the model and the data, a user's own by its folder's name ("vit_tiny on
    my_photos (data=imagenet)"; the built-in sets and a folder named as its config by the name)."""
    d = cfg.data
    from omegaconf import OmegaConf  # noqa: PLC0415 (the rank's: the launcher reads no title)

    root = None if d.get("synthetic") is not None else OmegaConf.select(d, "root", default=None)
    folder = Path(str(root)).expanduser().name if root else d.name
    return f"{cfg.model.name} on {folder}" + (f" (data={d.name})" if folder != d.name else "")
