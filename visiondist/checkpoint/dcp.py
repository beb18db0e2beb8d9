"""Saving and loading a checkpoint with torch.distributed.checkpoint (DCP), complete or absent.

Every rank calls `save_checkpoint` / `load_checkpoint`. Writing goes to
`checkpoints/.step_<N>.tmp/`, which is renamed to `step_<N>` once DCP's metadata, the trainer state
and every rank's RNG file are on disk (synchronously, or by a background thread under
`trainer.checkpoint_async`: `PendingSave`). Loading reads DCP's pickled `.metadata` with an
unpickler that admits only DCP's metadata classes (`SafeFileSystemReader`), and names the checkpoint
and what it lacked when a load fails."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from visiondist.checkpoint.files import (
    check_ema,
    fsync_dir,
    fsync_write,
    prune,
    read_trainer_state,
    remove_checkpoint,
)
from visiondist.checkpoint.state import (
    ema_state,
    hyperparameters,
    init_optimizer_state,
    model_state,
    optimizer_state,
    restore_hyperparameters,
    rng_state,
    set_rng_state,
)
from visiondist.models.weights import match_frozen_batchnorms
from visiondist.utils.dcp import CHECKPOINTS, STATE_FILE, SafeFileSystemReader, read_metadata

log = logging.getLogger(__name__)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    layout,
    keep_last: int = 0,
    ema=None,
    async_group: Any = False,
) -> Path | PendingSave:
    """Every rank calls this. Writes `checkpoints/step_<step>` atomically and keeps the newest
    `keep_last` (0: all) plus the best (`best.json`).

    `async_group` (a gloo process group, or None for the default group of a one-rank job): the state
    is copied to host memory now and written by a background thread over that group (DCP's
    async_save), and a `PendingSave` comes back; the directory is renamed to `step_<step>` by rank 0
    once every rank's write finished, so a checkpoint counts only when it is whole, as with the
    synchronous save."""
    root = Path(run_dir) / CHECKPOINTS
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if layout.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt that died mid-write
        for stale in root.glob(".step_*.deleting"):  # a deletion a killed process did not finish
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    fsync_write(tmp / f"rng_rank{layout.rank}.json", json.dumps(rng_state()))
    state = {
        "model": model_state(model, layout),
        "optim": optimizer_state(model, optimizer, layout),
    }
    if ema is not None:
        state["ema"] = ema_state(ema, layout)
    full = {
        **trainer_state,
        "step": step,
        "optimizer": hyperparameters(optimizer),
        "ema": ema is not None,
        "world_size": layout.world_size,
        "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp},
    }

    def complete() -> Path:
        """Rank 0, once every rank's tensors are on disk: the trainer state, the rename, the
        pruning."""
        fsync_write(tmp / STATE_FILE, json.dumps(full, indent=1))
        # the same step saved again (e.g. a resumed run re-saving): replace it whole
        if final.exists():
            remove_checkpoint(final)
        tmp.rename(final)
        fsync_dir(root)
        prune(run_dir, keep_last, keep=final)
        return final

    if async_group is not False:
        with warnings.catch_warnings():  # "experimental" notices
            warnings.simplefilter("ignore")
            future = dcp.async_save(
                state,
                checkpoint_id=str(tmp),
                process_group=async_group,
                no_dist=not dist.is_initialized(),
            )
        return PendingSave(step, final, future, complete if layout.is_main else None)
    dcp.save(state, checkpoint_id=str(tmp))  # collective; rank 0 writes .metadata last
    _barrier()  # every rank's files are written
    if layout.is_main:
        complete()
    _barrier()
    return final


class PendingSave:
    """An asynchronous checkpoint in flight: this rank's DCP write in a background thread and, on
    rank 0, the completion after it (`save_checkpoint`'s rename), plus whatever `then` adds (marking
    it the best). DCP's writes end with a gather of every rank's results on rank 0, so rank 0's
    write finishing means every rank's did."""

    def __init__(self, step: int, path: Path, future, complete=None):
        self.step, self.path = step, path
        self._after: list = [complete] if complete is not None else []
        self._error: Optional[BaseException] = None
        self._finished = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, args=(future,), name=f"checkpoint-{step}", daemon=True
        )
        self._thread.start()

    def _run(self, future) -> None:
        try:
            future.result()
            done = 0
            while True:
                with self._lock:
                    if done == len(self._after):
                        self._finished = True
                        return
                    action = self._after[done]
                action()
                done += 1
        except BaseException as exc:  # raised in the training thread by wait()
            with self._lock:
                self._error, self._finished = exc, True

    def then(self, action) -> None:
        """Run `action` (rank 0) once the checkpoint is complete: after the write, or now if it is
        complete."""
        with self._lock:
            if not self._finished:
                self._after.append(action)
                return
        if self._error is None:
            action()

    def wait(self, timeout: Optional[float] = None) -> Path:
        """The checkpoint, complete; raises if its write failed (or is still running after `timeout`
        s)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(
                f"the checkpoint of step {self.step} was still being written after {timeout:.0f}s"
            )
        if self._error is not None:
            raise RuntimeError(
                f"writing the checkpoint of step {self.step} failed: {self._error}"
            ) from self._error
        return self.path


def async_group(layout) -> Any:
    """The process group asynchronous saves run their collectives on: a gloo group of every rank
    (the background thread must not share the training's group, and DCP stages to host memory), or
    None in a one-rank job."""
    if not dist.is_initialized() or layout.world_size == 1:
        return None
    return dist.new_group(backend="gloo")


def freeze_as_saved(path: Path, model: nn.Module) -> int:
    """Freeze the BatchNorms of `model` (a whole one, under its canonical names) that the checkpoint
    at `path` saved frozen (`match_frozen_batchnorms`: a DETR-class detector trained with
    `freeze_backbone_batch_norms`, a torchvision detector started from pretrained weights), so that
    its tensors and optimizer state load as saved; before a wrapper or an optimizer holds the model.
    Returns how many were frozen."""
    return match_frozen_batchnorms(
        model,
        [
            k[len("model.") :]
            for k in read_metadata(path).state_dict_metadata
            if k.startswith("model.")
        ],
    )


def load_model_state(
    path: Path, model: nn.Module, layout=None, no_dist: bool = False, ema: bool = False
) -> None:
    """Load a checkpoint's model tensors into `model` (whatever layout either was saved or is in);
    `ema`: its trained parameters then replaced by the checkpoint's EMA averages of them (buffers
    and frozen parameters stay the model's, as the run's EMA evaluation had them). Without a
    process group (export, eval), or with `no_dist`, this process reads everything on its own."""
    freeze_as_saved(path, model)
    state = {"model": model_state(model, layout)}
    _dcp_load(state, path, no_dist)
    if not ema:
        return
    check_ema(path)
    averaged = {
        k[len("ema.") :] for k in read_metadata(path).state_dict_metadata if k.startswith("ema.")
    }
    _dcp_load({"ema": {k: v for k, v in state["model"].items() if k in averaged}}, path, no_dist)


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, layout, ema=None
) -> dict[str, Any]:
    """Every rank calls this: model and optimizer state (and the EMA, if both have one) into the
    live objects, the RNG states when the layout is the one the checkpoint was saved from. Returns
    the trainer state (step, epoch, schedule, ...); its "ema_restored" says whether the EMA came
    from the checkpoint."""
    path = Path(path)
    saved = read_trainer_state(path)
    init_optimizer_state(optimizer)
    state = {
        "model": model_state(model, layout),
        "optim": optimizer_state(model, optimizer, layout),
    }
    saved["ema_restored"] = ema is not None and bool(saved.get("ema"))
    if saved["ema_restored"]:
        state["ema"] = ema_state(ema, layout)
    _dcp_load(state, path)
    restore_hyperparameters(optimizer, saved["optimizer"])
    rng_file = path / f"rng_rank{layout.rank}.json"
    if saved.get("world_size") == layout.world_size and saved.get("layout") == {
        "dp": layout.dp,
        "tp": layout.tp,
        "pp": layout.pp,
    }:
        set_rng_state(json.loads(rng_file.read_text()))
        saved["rng_restored"] = True
    else:
        saved["rng_restored"] = False
    return saved


def _dcp_load(state: dict, path: Path, no_dist: bool = False) -> None:
    # read first: a tampered metadata pickle is refused here with its own message, and the key list
    # names what a failed load lacked
    stored = set(read_metadata(path).state_dict_metadata)
    try:
        # one process without a process group is the intended use here
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(str(path)),
                no_dist=no_dist or not dist.is_initialized(),
            )
    # the latter derives from BaseException # DCP wraps per-rank failures; say which checkpoint and
    # what to check
    except (Exception, CheckpointException) as exc:
        missing = [
            f"{group}.{key}"
            for group, tensors in state.items()
            for key in tensors
            if f"{group}.{key}" not in stored
        ]
        detail = (
            f"; it lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
            if missing
            else ""
        )
        cause = _root_cause(exc)
        if "zip archive" in str(cause) or isinstance(cause, (EOFError, pickle.UnpicklingError)):
            hint = (
                "a file of it is damaged or cut short (an interrupted copy?): use another "
                "checkpoint, or the run's model.safetensors"
            )
        else:
            hint = "is it from the same model (and optimizer)?"
        first = str(cause).split(". ")[0].splitlines()[0] if str(cause) else ""
        raise RuntimeError(
            f"could not load checkpoint {path}{detail}: {hint} ({type(cause).__name__}: {first})"
        ) from exc


def _root_cause(exc: BaseException) -> BaseException:
    """DCP's CheckpointException wraps each rank's (exception, traceback): the first rank's
    exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            return inner
    return exc
