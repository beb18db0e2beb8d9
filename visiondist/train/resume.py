"""The trainer's checkpoints: where a run continues from (`trainer.resume`), loading it into the live objects, and
saving this step (synchronously or in the background under `trainer.checkpoint_async`)."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from omegaconf import DictConfig

from visiondist.checkpoint.dcp import PendingSave, load_checkpoint, save_checkpoint
from visiondist.checkpoint.files import latest_checkpoint, resolve_checkpoint
from visiondist.parallel import reshard, unwrap
from visiondist.train.build import seed_everything
from visiondist.utils.heartbeat import PROGRESS

log = logging.getLogger(__name__)


def resume_path(cfg: DictConfig, run_dir: Path) -> Path | None:
    """The checkpoint `trainer.resume` names (auto: this run dir's latest complete one), or None."""
    spec = cfg.trainer.resume
    if spec is None:
        return None
    return latest_checkpoint(run_dir) if spec == "auto" else resolve_checkpoint(str(spec))


def epoch_position(step: int, steps_per_epoch: int, total_steps: int) -> str:
    """Where `step` stands, in the log lines' terms (epochs counted from 1 of the run's): "epoch 2/3, 60 of its 93
    steps done", or "the end of epoch 1/3"."""
    epochs = max(1, math.ceil(total_steps / steps_per_epoch))
    done, within = divmod(step, steps_per_epoch)
    if within == 0 and done > 0:
        return f"the end of epoch {done}/{epochs}"
    return f"epoch {done + 1}/{epochs}, {within} of its {steps_per_epoch} steps done"


class Checkpointing:
    """The `Trainer`'s checkpoints (a part of it: its model, optimizer, EMA, scheduler, scaler and step)."""

    def _resume(self, path: Path | None) -> Path | None:
        """Load `path` (`_resume_path`) into model, optimizer, schedule, step / data position and, under the same
        layout, the RNG states."""
        if path is None:
            continued = (Path(self.run_dir) / "attempts.jsonl").is_file()  # an earlier attempt ran here
            if self.cfg.trainer.resume == "auto" and continued and self.layout.is_main:
                log.warning("%s holds no complete checkpoint (an earlier attempt ended before writing one; "
                            "trainer.checkpoint_every=%d): training starts again at step 1", self.run_dir,
                            self.cfg.trainer.checkpoint_every)
            return None
        saved = load_checkpoint(path, unwrap(self.model), self.optimizer, self.layout, self.ema)
        if self.ema is not None and not saved["ema_restored"]:
            self.ema.reset()
            log.info("the checkpoint has no EMA: the average starts from its weights")
        self.scheduler.load_state_dict({"lr_lambdas": [None] * len(self.optimizer.param_groups), **saved["scheduler"]})
        self.step = int(saved["step"])
        self.earlier_seconds = saved.get("train_seconds")  # absent: a checkpoint that did not count them
        self.skipped_steps = int(saved.get("skipped_steps", 0))
        self.overflow_steps = int(saved.get("overflow_steps", 0))
        self.epoch = self.step // self.data.train_sampler.steps_per_epoch
        if self.scaler is not None:
            if saved.get("grad_scaler"):  # one value for the whole job, whatever the layout either run had
                self.scaler.load_state_dict(saved["grad_scaler"])
            else:
                log.info("the checkpoint is not from an fp16 run: the loss scale starts at %g", self.scaler.get_scale())
        if saved.get("total_steps") != self.total_steps:
            log.warning("the checkpoint's run had %s steps, this one has %d: the LR schedule follows this run's",
                        saved.get("total_steps"), self.total_steps)
        log.info("resumed from %s: step %d (%s)%s", path, self.step,
                 epoch_position(self.step, self.data.train_sampler.steps_per_epoch, self.total_steps),
                 "" if saved["rng_restored"] else
                 f" (saved with layout {saved.get('layout')}: random states restart from the seed)")
        if not saved["rng_restored"]:
            seed_everything(self.cfg.trainer.seed + self.step)
        return path


    def save_checkpoint(self, wait: bool = False) -> Path:
        """A checkpoint of this step. Under `trainer.checkpoint_async` the write continues in the background (at most
        one in flight: a previous one is waited for first) unless `wait`; returns its final path either way."""
        started = time.perf_counter()
        self.wait_checkpoint()
        self.settle()  # never save the weights of a step that turns out to have been non-finite
        PROGRESS.at("saving a checkpoint", self.step)
        reshard(self.model)  # FSDP: the parameters must be the sharded ones the optimizer holds
        state = {
            "epoch": self.epoch,
            "total_steps": self.total_steps,
            # the run's training seconds up to this step, over every attempt (a continued run's summary adds to it)
            **({"train_seconds": self.earlier_seconds + (self.timer.total_seconds if self.timer else 0.0)}
               if self.earlier_seconds is not None else {}),
            "scheduler": self.scheduler.state_dict(),  # LambdaLR: numbers only (its lambdas are rebuilt)
            "model": self.cfg.model.name,
            "data": self.cfg.data.name,
            "classes": list(self.data.classes),
            # detection: the COCO category id of labels 1..K (the export's label map)
            **({"category_ids": [cat for _, cat in sorted(self.data.cat_of_label.items())]}
               if hasattr(self.data, "cat_of_label") else {}),
            **({"grad_scaler": self.scaler.state_dict()} if self.scaler is not None else {}),  # scale, growth tracker
            # steps skipped so far, over every attempt (the summary counts the run's)
            "skipped_steps": self.skipped_steps, "overflow_steps": self.overflow_steps,
        }
        saved = save_checkpoint(self.run_dir, self.step, unwrap(self.model), self.optimizer, state, self.layout,
                                self.cfg.trainer.keep_last, self.ema, async_group=self._async_group)
        self.saved_step = self.step
        if isinstance(saved, PendingSave):
            self.pending_save = saved
            if wait:
                self.wait_checkpoint()
        else:
            self.last_checkpoint = saved
            log.info("saved checkpoint %s", saved)
        self.checkpoint_stall_s.append(time.perf_counter() - started)
        return saved.path if isinstance(saved, PendingSave) else saved

    def wait_checkpoint(self) -> None:
        """Wait for the save in flight (if any) to be complete on disk; it becomes the newest checkpoint."""
        pending = self.pending_save
        if pending is None:
            return
        self.last_checkpoint = pending.wait()
        self.pending_save = None
        log.info("saved checkpoint %s (written in the background)", pending.path)

