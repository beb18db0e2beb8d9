"""The run directory: created once per job (by the launching process, or by global rank 0 under
torchrun, which tells the others), with `config.yaml` as asked and `layout.json` as resolved; reused
only to continue a run. Its default is `<trainer.output_dir>/<date>/<time>/` for training,
`<trainer.output_dir>/<kind>/<date>_<time>/` for an entry with a `run_kind` (`eval`,
`benchmark`)."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, cast

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from visiondist.config import ConfigError
from visiondist.config.layout import RunLayout
from visiondist.runs import record_attempt


def new_run_dir(
    cfg: DictConfig, run: Optional[RunLayout] = None, kind: Optional[str] = None
) -> Path:
    """Create the run directory and write `config.yaml` (the run as asked, e.g. `parallel.auto:
    true`) and `layout.json` (the `RunLayout` it resolved to) into it. An existing run's directory
    is only reused to continue it (`trainer.resume=auto`): its config.yaml stays as asked, what this
    continuation changes (the layout included) is appended to `attempts.jsonl` (`visiondist.runs`),
    and layout.json becomes this attempt's (the layout its checkpoints are saved under). `kind`:
    see `default_run_dir`."""
    if cfg.trainer.run_dir:
        run_dir = Path(cfg.trainer.run_dir).expanduser()
        previous = run_dir / "config.yaml"
        if previous.exists():
            if cfg.trainer.resume != "auto":
                raise ConfigError(
                    f"trainer.run_dir={run_dir} already holds a run: choose another directory, or "
                    "continue it with trainer.resume=auto"
                )
            saved = cast(DictConfig, OmegaConf.load(previous))  # config.yaml: a mapping
            record_attempt(run_dir, saved, cfg, run)
            if run is not None:
                run.save(run_dir)
            return run_dir.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_dir = default_run_dir(cfg, kind)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    if run is not None:
        run.save(run_dir)
    return run_dir.resolve()


def default_run_dir(cfg: DictConfig, kind: Optional[str] = None) -> Path:
    """A new `<trainer.output_dir>/<date>/<time>/` for a training run,
    `<trainer.output_dir>/<kind>/<date>_<time>/` for another kind of job (`eval`, `benchmark`), so
    that only training runs look like training runs.

    Args:
        cfg: the job's config (`trainer.output_dir`).
        kind: the job's kind (`run_kind`); None: a training run.

    Returns:
        The new directory, created.
    """
    parent = Path(cfg.trainer.output_dir).expanduser()
    return unique_dir(parent) if kind is None else unique_dir(parent / kind, "%Y-%m-%d_%H-%M-%S")


def run_kind(entry: Callable) -> Optional[str]:
    """What an entry's run dir holds (its `run_kind` attribute: "eval", "predict", "benchmark");
    None: a training run.

    Args:
        entry: a rank's entry point, as `launch` takes it.
    """
    return getattr(entry, "run_kind", None)


# kinds that hold no training state: stopped at once, their layout never fitted
STATELESS = ("eval", "predict")


def unique_dir(parent: Path, pattern: str = "%Y-%m-%d/%H-%M-%S") -> Path:
    """A new directory `<parent>/<date>/<time>` (`pattern`, strftime), or `<time>-1`, `-2`, ... when
    that exists: created atomically, so jobs started in the same second (a sweep, two users, two
    launches) never share one.

    Args:
        parent: where the directory is made (created if missing).
        pattern: its path under `parent`, a strftime pattern of now.

    Returns:
        The new directory, resolved.
    """
    base = parent / dt.datetime.now().strftime(pattern)
    base.parent.mkdir(parents=True, exist_ok=True)
    path, n = base, 0
    while True:
        try:
            path.mkdir()
            return path.resolve()
        except FileExistsError:
            n += 1
            path = base.with_name(f"{base.name}-{n}")


def _shared_run_dir(cfg: DictConfig, run: RunLayout, kind: Optional[str] = None) -> Path:
    """Under torchrun: global rank 0 creates the run dir and tells the others (or tells them why it
    could not). After a torchrun restart (--max-restarts) the job continues in the run dir its first
    attempt created."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = str(_torchrun_run_dir(cfg, run, kind))
        except Exception as exc:  # every rank must learn of the failure, not hang in the broadcast
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return Path(box[0])


def _torchrun_run_dir(cfg: DictConfig, run: RunLayout, kind: Optional[str] = None) -> Path:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if cfg.trainer.run_dir or not run_id:
        return new_run_dir(cfg, run, kind)
    pointer = Path(cfg.trainer.output_dir).expanduser() / ".torchelastic" / run_id
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and pointer.is_file():
        return Path(pointer.read_text().strip())
    run_dir = new_run_dir(cfg, run, kind)
    pointer.parent.mkdir(parents=True, exist_ok=True)
    pointer.write_text(str(run_dir))
    return run_dir


def _write_plan(run_dir: Path, plan: Any) -> None:
    (run_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=1))
    devices = plan.hardware.devices
    (run_dir / "plan.txt").write_text(
        plan.text(f"parallel=auto on {devices} device{'s' if devices > 1 else ''}")
        + "\n"
        + f"chose {plan.choice.candidate.name}: {plan.reason}\n"
    )
