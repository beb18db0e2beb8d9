"""Distributed checkpoints: canonical, layout-free, complete or absent.

A checkpoint is a directory `<run>/checkpoints/step_<N>/` holding

- the model and optimizer state written with `torch.distributed.checkpoint` (DCP). Tensors carry their canonical
  (single-device) names and global shapes: a tensor-parallel shard is saved as a `DTensor` over the TP mesh, so DCP
  stores its slice and any other layout (ddp, tp2, tp4, dp2 x tp2) reads back whatever slice it needs. Replicated
  tensors are written once, whatever the number of ranks holding them.
- `trainer_state.json`: step, epoch, LR schedule, optimizer hyperparameters, fp16's loss scale (`grad_scaler`: the
  same on every rank), the layout it was saved from, the class names of the data (rank 0).
- `rng_rank<R>.json`: rank R's Python, NumPy, torch (and CUDA) RNG states.

Everything non-tensor is JSON and the tensors go through DCP's tensor path (`weights_only` loading): resuming never
unpickles an object. DCP's own `.metadata` file is a pickle; it is read with an unpickler that only admits DCP's
metadata classes (`SafeFileSystemReader`).

Writing goes to `checkpoints/.step_<N>.tmp/`, which is renamed to `step_<N>` once DCP's metadata, the trainer state
and every rank's RNG file are on disk; an old checkpoint is renamed to `.step_<N>.deleting/` before its files are
removed. A directory named `step_<N>` is therefore always whole. A crash mid-write or mid-delete leaves only a hidden
directory, which the next save replaces and which resume never looks at.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Shard

from visiondist.parallel.tensor import SHARD_DIM, persistent_buffers
from visiondist.utils.dcp import (
    CHECKPOINTS,
    METADATA,
    STATE_FILE,
    SafeFileSystemReader,
    is_complete,
    list_checkpoints,
    read_metadata,
)

log = logging.getLogger(__name__)



# -- finding checkpoints -------------------------------------------------------------------------------------------


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(spec: str, step: "Optional[int | str]" = None) -> Path:
    """A checkpoint from a user's path: a `step_<N>` directory, or a run directory (its latest checkpoint, or
    `step`: a number or "best", the best evaluated one the run kept)."""
    path = Path(spec).expanduser()
    if is_complete(path):
        return path
    if (path / CHECKPOINTS).is_dir() or (path / "config.yaml").is_file():
        found = dict(list_checkpoints(path))
        if step == "best":
            best = read_best(path)
            if best is None:
                raise FileNotFoundError(f"{path} kept no best checkpoint: train with trainer.best_metric=<metric>, "
                                        "e.g. val_top1 or val_mAP")
            step = int(best["step"])
        if step is not None:
            if step not in found:
                raise FileNotFoundError(f"{path} has no complete checkpoint of step {step}; it has: "
                                        f"{', '.join(map(str, found)) or 'none'}")
            return found[step]
        if found:
            return found[max(found)]
        raise FileNotFoundError(f"{path} has no complete checkpoint under {path / CHECKPOINTS}")
    if path.is_dir():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {METADATA} and {STATE_FILE}) nor a run dir")
    raise FileNotFoundError(f"no checkpoint at {path}")


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())


# -- canonical state ---------------------------------------------------------------------------------------------


def _tp_mesh(layout):
    return layout.mesh["tp"] if layout is not None and layout.tp > 1 else None


def _canonical(tensor: torch.Tensor, like: torch.Tensor, mesh) -> torch.Tensor:
    """`tensor` (this rank's part of something shaped like parameter `like`) as DCP should see it: a DTensor sharded
    over TP when `like` is a TP shard, the tensor itself otherwise."""
    dim = getattr(like, SHARD_DIM, None)
    if dim is None or mesh is None or tensor.shape != like.shape:
        return tensor
    return DTensor.from_local(tensor, mesh, [Shard(dim)], run_check=False)


def model_state(model: nn.Module, layout=None) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers under canonical names; TP shards as DTensors (views of the live
    tensors, so loading into this dict loads into the model)."""
    mesh = _tp_mesh(layout)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        state[name] = _canonical(param.detach(), param, mesh)
    for name, buffer in persistent_buffers(model):
        if name not in state:
            state[name] = buffer.detach()
    return state


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, layout=None) -> dict[str, torch.Tensor]:
    """Per-parameter optimizer state keyed `<param name>/<state key>`, sharded like its parameter."""
    mesh = _tp_mesh(layout)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {name}/{key} is a {type(value).__name__}, not a tensor")
            state[f"{name}/{key}"] = _canonical(value, param, mesh)
    return state


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state tensors (so a checkpoint has somewhere to load into) without
    changing any parameter: one step at lr 0 from zero gradients, then the gradients are cleared again."""
    if optimizer.state:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


def _restore_hyperparameters(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(saved)} optimizer parameter groups, this optimizer "
                         f"{len(optimizer.param_groups)}: resume with the optimizer it was saved with")
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value


# -- RNG states as JSON ---------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8))


# -- save / load ----------------------------------------------------------------------------------------------------


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def ema_state(ema, layout=None) -> dict[str, torch.Tensor]:
    """A `ModelEma`'s averages under their parameters' canonical names, sharded like them."""
    mesh = _tp_mesh(layout)
    return {name: _canonical(shadow, param, mesh) for name, shadow, param in ema.named_shadows()}


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], layout, keep_last: int = 0, ema=None,
                    async_group: Any = False) -> "Path | PendingSave":
    """Every rank calls this. Writes `checkpoints/step_<step>` atomically and keeps the newest `keep_last` (0: all)
    plus the best (`best.json`).

    `async_group` (a gloo process group, or None for the default group of a one-rank job): the state is copied to
    host memory now and written by a background thread over that group (DCP's async_save), and a `PendingSave`
    comes back; the directory is renamed to `step_<step>` by rank 0 once every rank's write finished, so a checkpoint
    counts only when it is whole, as with the synchronous save."""
    root = Path(run_dir) / CHECKPOINTS
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if layout.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt that died mid-write
        for stale in root.glob(".step_*.deleting"):  # a deletion a killed process did not finish
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    _fsync_write(tmp / f"rng_rank{layout.rank}.json", json.dumps(rng_state()))
    state = {"model": model_state(model, layout), "optim": optimizer_state(model, optimizer, layout)}
    if ema is not None:
        state["ema"] = ema_state(ema, layout)
    full = {**trainer_state, "step": step, "optimizer": _hyperparameters(optimizer), "ema": ema is not None,
            "world_size": layout.world_size, "layout": {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp}}

    def complete() -> Path:
        """Rank 0, once every rank's tensors are on disk: the trainer state, the rename, the pruning."""
        _fsync_write(tmp / STATE_FILE, json.dumps(full, indent=1))
        if final.exists():  # the same step saved again (e.g. a resumed run re-saving): replace it whole
            _remove(final)
        tmp.rename(final)
        _fsync_dir(root)
        prune(run_dir, keep_last, keep=final)
        return final

    if async_group is not False:
        with warnings.catch_warnings():  # "experimental" notices
            warnings.simplefilter("ignore")
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=async_group,
                                    no_dist=not dist.is_initialized())
        return PendingSave(step, final, future, complete if layout.is_main else None)
    dcp.save(state, checkpoint_id=str(tmp))  # collective; rank 0 writes .metadata last
    _barrier()  # every rank's files are written
    if layout.is_main:
        complete()
    _barrier()
    return final


class PendingSave:
    """An asynchronous checkpoint in flight: this rank's DCP write in a background thread and, on rank 0, the
    completion after it (`save_checkpoint`'s rename), plus whatever `then` adds (marking it the best). DCP's writes
    end with a gather of every rank's results on rank 0, so rank 0's write finishing means every rank's did."""

    def __init__(self, step: int, path: Path, future, complete=None):
        import threading

        self.step, self.path = step, path
        self._after: list = [complete] if complete is not None else []
        self._error: Optional[BaseException] = None
        self._finished = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(future,), name=f"checkpoint-{step}", daemon=True)
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
        """Run `action` (rank 0) once the checkpoint is complete: after the write, or now if it is complete."""
        with self._lock:
            if not self._finished:
                self._after.append(action)
                return
        if self._error is None:
            action()

    def wait(self, timeout: Optional[float] = None) -> Path:
        """The checkpoint, complete; raises if its write failed (or is still running after `timeout` s)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the checkpoint of step {self.step} was still being written after {timeout:.0f}s")
        if self._error is not None:
            raise RuntimeError(f"writing the checkpoint of step {self.step} failed: {self._error}") from self._error
        return self.path


def async_group(layout) -> Any:
    """The process group asynchronous saves run their collectives on: a gloo group of every rank (the background
    thread must not share the training's group, and DCP stages to host memory), or None in a one-rank job."""
    if not dist.is_initialized() or layout.world_size == 1:
        return None
    return dist.new_group(backend="gloo")


BEST = "best.json"


def read_best(run_dir: Path) -> Optional[dict[str, Any]]:
    """`checkpoints/best.json`: {"metric", "mode", "value", "step"} of the best evaluated checkpoint, if any."""
    path = Path(run_dir) / CHECKPOINTS / BEST
    return json.loads(path.read_text()) if path.is_file() else None


def mark_best(run_dir: Path, record: dict[str, Any], keep_last: int) -> None:
    """Rank 0: record a complete checkpoint as the best (atomically), then drop the previous best unless it is among
    the newest `keep_last`."""
    root = Path(run_dir) / CHECKPOINTS
    tmp = root / f".{BEST}.tmp"
    _fsync_write(tmp, json.dumps(record, indent=1))
    tmp.replace(root / BEST)
    _fsync_dir(root)
    prune(run_dir, keep_last)


def prune(run_dir: Path, keep_last: int, keep: Optional[Path] = None) -> None:
    """Remove the complete checkpoints older than the newest `keep_last` (0: keep all), sparing `keep` and the
    best one."""
    if keep_last <= 0:
        return
    best = read_best(run_dir)
    for step, old in list_checkpoints(run_dir)[:-keep_last]:
        if old != keep and (best is None or step != best["step"]):
            _remove(old)


def _remove(checkpoint: Path) -> None:
    """Delete a checkpoint so that no half-deleted `step_<N>` is ever visible: renamed out of the `step_<N>` names
    first (one atomic rename), then removed file by file."""
    trash = checkpoint.with_name(f".{checkpoint.name}.deleting")
    shutil.rmtree(trash, ignore_errors=True)
    checkpoint.rename(trash)
    _fsync_dir(checkpoint.parent)
    shutil.rmtree(trash, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_model_state(path: Path, model: nn.Module, layout=None, no_dist: bool = False) -> None:
    """Load a checkpoint's model tensors into `model` (whatever layout either was saved or is in). Without a
    process group (export, eval), or with `no_dist`, this process reads everything on its own."""
    from visiondist.models.weights import match_frozen_batchnorms

    match_frozen_batchnorms(model, [k[len("model."):] for k in read_metadata(path).state_dict_metadata
                                    if k.startswith("model.")])
    state = {"model": model_state(model, layout)}
    _dcp_load(state, path, no_dist)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, layout,
                    ema=None) -> dict[str, Any]:
    """Every rank calls this: model and optimizer state (and the EMA, if both have one) into the live objects, the
    RNG states when the layout is the one the checkpoint was saved from. Returns the trainer state (step, epoch,
    schedule, ...); its "ema_restored" says whether the EMA came from the checkpoint."""
    path = Path(path)
    saved = read_trainer_state(path)
    init_optimizer_state(optimizer)
    state = {"model": model_state(model, layout), "optim": optimizer_state(model, optimizer, layout)}
    saved["ema_restored"] = ema is not None and bool(saved.get("ema"))
    if saved["ema_restored"]:
        state["ema"] = ema_state(ema, layout)
    _dcp_load(state, path)
    _restore_hyperparameters(optimizer, saved["optimizer"])
    rng_file = path / f"rng_rank{layout.rank}.json"
    if saved.get("world_size") == layout.world_size and saved.get("layout") == {"dp": layout.dp, "tp": layout.tp,
                                                                                  "pp": layout.pp}:
        set_rng_state(json.loads(rng_file.read_text()))
        saved["rng_restored"] = True
    else:
        saved["rng_restored"] = False
    return saved


def _dcp_load(state: dict, path: Path, no_dist: bool = False) -> None:
    # read first: a tampered metadata pickle is refused here with its own message, and the key list names what a
    # failed load lacked
    stored = set(read_metadata(path).state_dict_metadata)
    try:
        with warnings.catch_warnings():  # one process without a process group is the intended use here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), no_dist=no_dist or not dist.is_initialized())
    except (Exception, CheckpointException) as exc:  # the latter derives from BaseException  # DCP wraps per-rank failures; say which checkpoint and what to check
        missing = [f"{group}.{key}" for group, tensors in state.items() for key in tensors
                   if f"{group}.{key}" not in stored]
        detail = f"; it lacks {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}" if missing else ""
        cause = _root_cause(exc)
        if "zip archive" in str(cause) or isinstance(cause, (EOFError, pickle.UnpicklingError)):
            hint = ("a file of it is damaged or cut short (an interrupted copy?): use another checkpoint, or the run's "
                    "model.safetensors")
        else:
            hint = "is it from the same model (and optimizer)?"
        first = str(cause).split(". ")[0].splitlines()[0] if str(cause) else ""
        raise RuntimeError(f"could not load checkpoint {path}{detail}: {hint} ({type(cause).__name__}: {first})"
                           ) from exc


def _root_cause(exc: BaseException) -> BaseException:
    """DCP's CheckpointException wraps each rank's (exception, traceback): the first rank's exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            return inner
    return exc

