"""The training loop's checkpoints: where a run continues from (`trainer.resume`), loading it into
the live parts, and saving a step (synchronously, or in the background under
`trainer.checkpoint_async`)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional, cast

from omegaconf import DictConfig

from visiondist.checkpoint.dcp import PendingSave, async_group, load_checkpoint, save_checkpoint
from visiondist.checkpoint.files import latest_checkpoint, resolve_checkpoint
from visiondist.engine.build import seed_everything
from visiondist.engine.components import Components
from visiondist.engine.state import LoopState, Resumed
from visiondist.parallel import Layout, reshard, unwrap
from visiondist.utils.heartbeat import PROGRESS

log = logging.getLogger(__name__)


NO_CADENCE = "trainer.checkpoint_every=0, trainer.checkpoint_every_min=0"


def cadence(t: DictConfig) -> str:
    """How often the run checkpoints during it, for the lines that say what a job killed outright
    keeps: "one every 30 minutes", "one every 500 steps or 30 minutes", or "" (only when it ends or
    is stopped).

    Args:
        t: the config's `trainer`.

    Returns:
        The cadence in words, or "".
    """
    every, minutes = int(t.checkpoint_every), float(t.get("checkpoint_every_min", 0))
    parts = []
    if every > 0:
        parts.append(f"{every} step{'s' if every != 1 else ''}")
    if minutes > 0:
        parts.append(f"{minutes:g} minute{'s' if minutes != 1 else ''}")
    return f"one every {' or '.join(parts)}" if parts else ""


def resume_path(cfg: DictConfig, run_dir: Path) -> Optional[Path]:
    """The checkpoint `trainer.resume` names (auto: this run dir's latest complete one), or None."""
    spec = cfg.trainer.resume
    if spec is None:
        return None
    return latest_checkpoint(run_dir) if spec == "auto" else resolve_checkpoint(str(spec))


def epoch_position(step: int, steps_per_epoch: int, total_steps: int) -> str:
    """Where `step` stands, in the log lines' terms (epochs counted from 1 of the run's): "epoch
    2/3, 60 of its 93 steps done", or "the end of epoch 1/3"."""
    epochs = max(1, math.ceil(total_steps / steps_per_epoch))
    done, within = divmod(step, steps_per_epoch)
    if within == 0 and done > 0:
        return f"the end of epoch {done}/{epochs}"
    return f"epoch {done + 1}/{epochs}, {within} of its {steps_per_epoch} steps done"


def _layout_text(saved: Any) -> str:
    """A checkpoint's recorded layout as the log lines say one: `dp=1 tp=2 pp=1`."""
    if not isinstance(saved, dict):
        return f"another layout ({saved})"
    return " ".join(f"{k}={v}" for k, v in saved.items())


def resume(
    cfg: DictConfig, layout: Layout, run_dir: Path, parts: Components, path: Optional[Path]
) -> Resumed:
    """Load the checkpoint at `path` (`resume_path`) into the parts' model, optimizer, EMA, schedule
    and loss scale and, under the same layout, the RNG states; what it says of the run (its step,
    the steps it skipped, its training seconds) starts the loop state. None: a new run, at step
    0."""
    if path is None:
        continued = (Path(run_dir) / "attempts.jsonl").is_file()  # an earlier attempt ran here
        if cfg.trainer.resume == "auto" and continued and layout.is_main:
            log.warning(
                "%s holds no complete checkpoint (an earlier attempt ended before writing one; "
                "%s): training starts again at step 1",
                run_dir,
                cadence(cfg.trainer) or NO_CADENCE,
            )
        return Resumed()
    # this run's settings (optim.lr, weight_decay, betas, ...): the checkpoint's groups replace them
    configured = [
        {k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups
    ]
    saved = load_checkpoint(path, unwrap(parts.model), parts.optimizer, layout, parts.ema)
    if parts.ema is not None and not saved["ema_restored"]:
        parts.ema.reset()
        log.info("the checkpoint has no EMA: the average starts from its weights")
    parts.scheduler.load_state_dict(
        {"lr_lambdas": [None] * len(parts.optimizer.param_groups), **saved["scheduler"]}
    )
    _apply_settings(parts, configured, layout.is_main)
    step = int(saved["step"])
    if parts.scaler is not None:
        # one value for the whole job, whatever the layout either run had
        if saved.get("grad_scaler"):
            parts.scaler.load_state_dict(saved["grad_scaler"])
        else:
            log.info(
                "the checkpoint is not from an fp16 run: the loss scale starts at %g",
                parts.scaler.get_scale(),
            )
    if saved.get("total_steps") != parts.total_steps and layout.is_main:  # once, not per rank
        # the run's own checkpoint: trained on (or shortened) as asked, a line; another run's: heed
        own = Path(path).resolve().is_relative_to(Path(run_dir).resolve())
        (log.info if own else log.warning)(
            "the checkpoint's run had %s steps, this one has %d: the LR schedule follows this "
            "run's",
            saved.get("total_steps"),
            parts.total_steps,
        )
    steps_per_epoch = parts.data.train_sampler.steps_per_epoch
    log.info(
        "resumed from %s: step %d (%s)%s",
        path,
        step,
        epoch_position(step, steps_per_epoch, parts.total_steps),
        ""
        if saved["rng_restored"]
        else f" (saved under {_layout_text(saved.get('layout'))}: the random states, which are "
        "per rank, restart from the seed)",
    )
    if not saved["rng_restored"]:
        seed_everything(cfg.trainer.seed + step)
    return Resumed(
        checkpoint=path,
        step=step,
        skipped_steps=int(saved.get("skipped_steps", 0)),
        overflow_steps=int(saved.get("overflow_steps", 0)),
        # absent: a checkpoint that did not count them
        earlier_seconds=saved.get("train_seconds"),
    )


def _apply_settings(parts: Components, configured: list[dict[str, Any]], say: bool) -> None:
    """The optimizer's hyperparameters as this run configures them (a continuation may change
    optim.lr, optim.weight_decay, ...; the checkpoint restores the moments and the step count), the
    schedule continuing from its step at this run's peak rate."""
    # a LambdaLR (`optim.build_scheduler`)
    groups, scheduler = parts.optimizer.param_groups, cast(Any, parts.scheduler)
    before = [g.get("initial_lr", g["lr"]) for g in groups]
    changed = sorted(
        {k for g, c in zip(groups, configured) for k, v in c.items() if k in g and g[k] != v}
        - {"lr", "initial_lr"}
    )
    for i, (group, settings) in enumerate(zip(groups, configured)):
        group.update(settings)
        peak = settings.get("initial_lr", settings["lr"])
        group["initial_lr"] = scheduler.base_lrs[i] = peak
        group["lr"] = peak * scheduler.lr_lambdas[i](scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in groups]  # what get_last_lr() reports
    peaks = [g["initial_lr"] for g in groups]
    if say and (peaks != before or changed):
        log.info(
            "the optimizer continues with this run's settings%s%s",
            f": peak LR {max(before):.3g} -> {max(peaks):.3g}" if peaks != before else "",
            f"; {', '.join(changed)} as configured" if changed else "",
        )


class Checkpointing:
    """A part the loop holds: it saves the parts and the loop state's step, and owns what it saved
    (the newest complete checkpoint, the save in flight, the step of the newest save and how long
    each save held training up). `settle` acts on the step verdicts still in flight before a save:
    no checkpoint holds the weights of a step that turns out to have been non-finite."""

    def __init__(
        self,
        cfg: DictConfig,
        layout: Layout,
        run_dir: Path,
        parts: Components,
        state: LoopState,
        settle: Callable[[], None],
    ):
        self.cfg, self.layout, self.run_dir, self.parts, self.state, self.settle = (
            cfg,
            layout,
            run_dir,
            parts,
            state,
            settle,
        )
        self.last_checkpoint = state.resumed.checkpoint  # the newest complete checkpoint
        # the newest save's (any)
        self.saved_step = state.step if state.resumed.checkpoint is not None else -1
        # trainer.checkpoint_async: the save being written
        self.pending: Optional[PendingSave] = None
        self.stall_s: list[float] = []  # the seconds each save held up training
        self._async_group = async_group(layout) if cfg.trainer.checkpoint_async else False

    def save(self, wait: bool = False) -> Path:
        """A checkpoint of this step. Under `trainer.checkpoint_async` the write continues in the
        background (at most one in flight: a previous one is waited for first) unless `wait`;
        returns its final path either way."""
        started = time.perf_counter()
        self.wait()
        self.settle()  # never save the weights of a step that turns out to have been non-finite
        state, parts = self.state, self.parts
        PROGRESS.at("saving a checkpoint", state.step)
        reshard(parts.model)  # FSDP: the parameters must be the sharded ones the optimizer holds
        trainer_state = {
            "epoch": state.epoch,
            "total_steps": parts.total_steps,
            # the run's training seconds up to this step, over every attempt (a continued run's
            # summary adds to it)
            **(
                {"train_seconds": earlier + (state.timer.total_seconds if state.timer else 0.0)}
                if (earlier := state.resumed.earlier_seconds) is not None
                else {}
            ),
            # LambdaLR: numbers only (its lambdas are rebuilt)
            "scheduler": parts.scheduler.state_dict(),
            "model": self.cfg.model.name,
            "data": self.cfg.data.name,
            "classes": list(parts.data.classes),
            # detection: the COCO category id of labels 1..K (the export's label map)
            **(
                {"category_ids": [cat for _, cat in sorted(parts.data.cat_of_label.items())]}
                if hasattr(parts.data, "cat_of_label")
                else {}
            ),
            # scale, growth tracker
            **({"grad_scaler": parts.scaler.state_dict()} if parts.scaler is not None else {}),
            # steps skipped so far, over every attempt (the summary counts the run's)
            "skipped_steps": state.skipped_steps,
            "overflow_steps": state.overflow_steps,
        }
        saved = save_checkpoint(
            self.run_dir,
            state.step,
            unwrap(parts.model),
            parts.optimizer,
            trainer_state,
            self.layout,
            self.cfg.trainer.keep_last,
            parts.ema,
            async_group=self._async_group,
        )
        self.saved_step = state.step
        if isinstance(saved, PendingSave):
            self.pending = saved
            if wait:
                self.wait()
        else:
            self.last_checkpoint = saved
            log.info("saved checkpoint %s", saved)
        self.stall_s.append(time.perf_counter() - started)
        return saved.path if isinstance(saved, PendingSave) else saved

    def wait(self) -> None:
        """Wait for the save in flight (if any) to be complete on disk; it becomes the newest
        checkpoint."""
        pending = self.pending
        if pending is None:
            return
        self.last_checkpoint = pending.wait()
        self.pending = None
        log.info("saved checkpoint %s (written in the background)", pending.path)
