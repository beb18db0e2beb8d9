"""The checkpoints of a run directory: finding them (latest, by step, the best), the best one's
record, and removing old ones so that no half-deleted `step_<N>` is ever visible."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from visiondist.utils.dcp import CHECKPOINTS, METADATA, STATE_FILE, is_complete, list_checkpoints

# -- finding checkpoints ---------------------------------------------------------------------------


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(spec: str, step: Optional[int | str] = None) -> Path:
    """A checkpoint from a user's path: a `step_<N>` directory, or a run directory (its latest
    checkpoint, or `step`: a number or "best", the best evaluated one the run kept)."""
    path = Path(spec).expanduser()
    if is_complete(path):
        return path
    if (path / CHECKPOINTS).is_dir() or (path / "config.yaml").is_file():
        found = dict(list_checkpoints(path))
        if step == "best":
            best = read_best(path)
            if best is None:
                raise FileNotFoundError(
                    f"{path} kept no best checkpoint: train with trainer.best_metric=<metric> "
                    "(val_top1 for a classifier, val_mAP for a detector), or give step=<N> (no "
                    "step: the newest)"
                )
            step = int(best["step"])
        if step is not None:
            if step not in found:
                raise FileNotFoundError(
                    f"{path} has no complete checkpoint of step {step}; it has: "
                    f"{', '.join(map(str, found)) or 'none'}"
                )
            return found[step]
        if found:
            return found[max(found)]
        raise FileNotFoundError(f"{path} has no complete checkpoint under {path / CHECKPOINTS}")
    if path.is_dir():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no {METADATA} and {STATE_FILE}) nor a run dir"
        )
    raise FileNotFoundError(f"no checkpoint at {path}")


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())


# -- canonical state -------------------------------------------------------------------------------


def fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


BEST = "best.json"


def read_best(run_dir: Path) -> Optional[dict[str, Any]]:
    """`checkpoints/best.json`: {"metric", "mode", "value", "step"} of the best evaluated
    checkpoint, if any."""
    path = Path(run_dir) / CHECKPOINTS / BEST
    return json.loads(path.read_text()) if path.is_file() else None


def ema_wanted(run_dir: Path, step: Optional[int | str], ema: bool) -> tuple[bool, str]:
    """Whether a run's weights are read as its checkpoint's EMA: as asked (`ema`), or where
    step="best" picks the checkpoint that was best by an EMA metric (`val_ema_*`), whose raw
    weights never scored that figure; with the line that says the latter ("" otherwise)."""
    if ema or step != "best":
        return ema, ""
    metric = str((read_best(run_dir) or {}).get("metric", ""))
    if not metric.startswith("val_ema_"):
        return False, ""
    return True, f"step=best is the best checkpoint by {metric}: its EMA weights are read"


def check_ema(path: Path) -> None:
    """ValueError unless checkpoint `path` holds an EMA of its weights."""
    if not read_trainer_state(path).get("ema"):
        raise ValueError(
            f"{path} holds no EMA of the weights (its run trained with trainer.ema_decay=0): drop "
            "ema=true"
        )


def mark_best(run_dir: Path, record: dict[str, Any], keep_last: int) -> None:
    """Rank 0: record a complete checkpoint as the best (atomically), then drop the previous best
    unless it is among the newest `keep_last`."""
    root = Path(run_dir) / CHECKPOINTS
    tmp = root / f".{BEST}.tmp"
    fsync_write(tmp, json.dumps(record, indent=1))
    tmp.replace(root / BEST)
    fsync_dir(root)
    prune(run_dir, keep_last)


def prune(run_dir: Path, keep_last: int, keep: Optional[Path] = None) -> None:
    """Remove the complete checkpoints older than the newest `keep_last` (0: keep all), sparing
    `keep` and the best one."""
    if keep_last <= 0:
        return
    best = read_best(run_dir)
    for step, old in list_checkpoints(run_dir)[:-keep_last]:
        if old != keep and (best is None or step != best["step"]):
            remove_checkpoint(old)


def remove_checkpoint(checkpoint: Path) -> None:
    """Delete a checkpoint so that no half-deleted `step_<N>` is ever visible: renamed out of the
    `step_<N>` names first (one atomic rename), then removed file by file."""
    trash = checkpoint.with_name(f".{checkpoint.name}.deleting")
    shutil.rmtree(trash, ignore_errors=True)
    checkpoint.rename(trash)
    fsync_dir(checkpoint.parent)
    shutil.rmtree(trash, ignore_errors=True)


def fsync_dir(path: Path) -> None:
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
