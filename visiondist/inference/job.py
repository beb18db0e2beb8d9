"""What a prediction is asked to do, in the launching process's terms (no torch): the weights of a
run, the images per forward, how many are drawn, and the request that tells one prediction from
another (a stopped one is continued only under the same request)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from visiondist.checkpoint.files import (
    check_ema,
    ema_wanted,
    latest_checkpoint,
    resolve_checkpoint,
)
from visiondist.config import ConfigError
from visiondist.inference.sources import Source
from visiondist.models import TASKS
from visiondist.models.exported import export_record


def weights_of_run(run: Path, step, cfg: DictConfig) -> Path:
    """`run_weights` for a run evaluated or predicted under `cfg`, whose `model.weights_ema`
    (tools' ema=true) is made what the loading ranks read: true for a step=best that was best by
    an EMA metric (said here)."""
    ema, said = ema_wanted(run, step, bool(cfg.model.get("weights_ema", False)))
    if said:
        print(said, flush=True)
    path = run_weights(run, step, ema)
    OmegaConf.update(cfg, "model.weights_ema", ema, force_add=True)
    return path


def run_weights(run: Path, step=None, ema: bool = False) -> Path:
    """A run's weights: checkpoint `step` (a number or "best"), else its model.safetensors, else its
    newest checkpoint (a run stopped early); ConfigError when it holds none. `ema`: a checkpoint
    with its EMA (the newest where no step is given)."""
    if ema:
        try:
            path = resolve_checkpoint(str(run), step)
            check_ema(path)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError(
                f"ema=true reads a checkpoint's EMA of the weights (model.safetensors holds the "
                f"model's own): {exc}"
            ) from None
        return path
    if step is not None:
        try:
            return resolve_checkpoint(str(run), step)
        except FileNotFoundError as exc:
            raise ConfigError(f"step={step}: {exc}") from None
    weights = run / "model.safetensors"
    if not weights.is_file():
        weights = latest_checkpoint(run) or weights
    if not weights.exists():
        raise ConfigError(
            f"run_dir={run} holds no model.safetensors and no complete checkpoint: give "
            "weights=<file> or a run that saved its weights"
        )
    return weights


def run_of_weights(weights: Path, overrides: Sequence[str]) -> Optional[Path]:
    """The training run `weights` are of (its model.safetensors, or a checkpoint in its
    checkpoints/), where `overrides` switch no config group: its config.yaml then gives the model
    and the preprocessing it was trained with, which the file alone does not record. None
    otherwise (an export records its own)."""
    if any("=" in o and "." not in o.split("=", 1)[0] for o in overrides):  # model=..., data=...
        return None
    weights = weights.expanduser().resolve()
    run = weights.parent.parent if weights.parent.name == "checkpoints" else weights.parent
    return run if (run / "config.yaml").is_file() else None


def check_file(cfg: DictConfig, weights: Path) -> None:
    """The file against the model, before anything is printed or any rank starts (as tools/eval.py
    does): an export's graph or program, a file of another model, is refused in one line naming this
    tool's key."""
    from visiondist.models.exported import check_runtime_file, runtime_of  # noqa: PLC0415
    from visiondist.models.weights_check import check_weights  # noqa: PLC0415 (a job's)

    model = OmegaConf.merge(cfg.model, {"weights": str(weights.resolve())})
    try:
        if runtime_of(weights):  # an exported file: its runtime runs it
            check_runtime_file(model, weights)
            return
        check_weights(model, "eval", OmegaConf.select(cfg, "data.num_classes", default=None))
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("model.weights=", "weights=")) from None


def batch_size(cfg: DictConfig) -> int:
    """Images per forward on each rank: predict.batch_size, else data.eval_batch_size."""
    return int(cfg.predict.batch_size) or int(cfg.data.eval_batch_size)


def drawn_count(cfg: DictConfig, count: int) -> int:
    value = str(cfg.predict.save_images).strip().lower()
    return count if value == "all" else min(count, int(value))


def request(cfg: DictConfig, source: Source) -> dict[str, Any]:
    """What makes two predictions the same one (a stopped one continues only under the same
    request): the source, the weights (path, size and time), and every setting that changes an
    output."""
    weights = Path(cfg.model.weights)
    inside = [
        weights / name for name in (".metadata", "model.safetensors") if (weights / name).is_file()
    ]
    # a checkpoint's, a from_pretrained dir's
    stat = (inside[0] if weights.is_dir() and inside else weights).stat()
    p = cfg.predict
    saved = str(p.save_images).strip().lower()
    return {
        "source": str(Path(source.spec).expanduser().resolve())
        if not any(c in source.spec for c in "*?[")
        else source.spec,
        "items": len(source),
        "files": fingerprint(source),
        "weights": str(weights),
        # an exported file's preprocessing is its model config's (size, crop)
        "model": str(cfg.model.name),
        **_task_settings(cfg),
        "weights_size": stat.st_size,
        "weights_mtime": int(stat.st_mtime),
        "classes": list(p.classes) if p.classes else None,
        "save_images": saved if saved == "all" else int(saved),
        "vid_stride": int(p.vid_stride),
        "save_txt": bool(p.get("save_txt", False)),
        "batch_size": batch_size(cfg),
        "precision": str(cfg.trainer.precision),
    }


def _task_settings(cfg: DictConfig) -> dict[str, Any]:
    """The settings of the model's task that change its outputs: a classifier's input size and
    top-k; a detector's input size (a DETR-class square, else data.min_size / max_size), score
    threshold and detections per image."""
    p, m = cfg.predict, cfg.model
    if TASKS[m.family] == "classification":
        return {"img_size": int(m.img_size), "topk": int(p.topk)}
    size = (
        {"img_size": int(m.img_size)}
        if m.family == "detr"
        else {"min_size": int(m.min_size), "max_size": int(m.max_size)}
    )
    return {**size, "score_thresh": float(p.score_thresh), "max_det": int(p.max_det)}


def fingerprint(source: Source) -> str:
    """A digest of the source's files: each one's path, size and modification time (a video: its
    own), so that a folder whose files changed is a new prediction, not a complete or continued one.
    A file that is gone counts as such (the rank names it)."""
    digest = hashlib.sha256()
    for path in [source.video] if source.video else source.paths:
        try:
            st = os.stat(path)
            digest.update(f"{path}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
        except OSError:
            digest.update(f"{path}\tmissing\n".encode())
    return digest.hexdigest()[:32]


# what an export's sidecar records of the run's eval
PREPROCESSING = ("mean", "std", "crop_pct", "interpolation")


def recorded_preprocessing(weights: Path) -> tuple[dict[str, Any], str]:
    """The run's evaluation preprocessing as an export recorded it (mean, std, crop_pct,
    interpolation), as `data` overrides, and where: tools/export.py's sidecar `<name>.json` beside
    the weights (its "preprocessing" entry for an OpenVINO IR), else an ONNX graph's own metadata
    (`models.exported.export_record`); empty where nothing is recorded."""
    info, where = export_record(weights)
    if isinstance(info.get("preprocessing"), dict):
        info = info["preprocessing"]
    return {k: info[k] for k in PREPROCESSING if k in info}, where


def recorded_data(weights: Path, overrides: Sequence[str]) -> tuple[dict[str, Any], str]:
    """An export's recorded preprocessing (`recorded_preprocessing`) as `data` overrides, less the
    keys the command line gives (they win), and the line that says what was taken ("" for
    nothing)."""
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    recorded, where = recorded_preprocessing(weights)
    data = {k: v for k, v in recorded.items() if f"data.{k}" not in given}
    if not data:
        return {}, ""
    said = " ".join(f"data.{k}={v}" for k, v in data.items())
    return data, f"preprocessing as {where} records the run's: {said}"
