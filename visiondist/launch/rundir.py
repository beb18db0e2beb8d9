"""The run directory: created once per job (by the launching process, or by global rank 0 under
torchrun, which tells the others), with `config.yaml` as asked and `layout.json` as resolved; reused
only to continue a run. Its default is `<trainer.output_dir>/<date>/<time>/` for training,
`<trainer.output_dir>/<kind>/<date>_<time>/` for an entry with a `run_kind` (`eval`,
`benchmark`)."""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, cast

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
        run_dir.mkdir(parents=True, exist_ok=True)
        hold(run_dir)  # before reading it: a second job started at once finds it held
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
    else:
        run_dir = default_run_dir(cfg, kind)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    if run is not None:
        run.save(run_dir)
    return run_dir.resolve()


# the file a job holds locked while it runs in a run dir it was given (trainer.run_dir)
_HELD_FILE = ".running"
_HELD: dict[str, int] = {}  # run dir -> the open, locked file of this process's job


def hold(run_dir: Path) -> None:
    """This process's job holds `run_dir` (an advisory lock on `<run_dir>/.running`, which says who
    holds it) until the job ends (`run_dirs_released`) or the process does: a second job given the
    same trainer.run_dir (a copy of the command, a pod rescheduled beside the one still running)
    stops before it writes, naming the holder, instead of both appending to one metrics.csv and
    writing one checkpoint. Where the file system has no locks, nothing is held."""
    key = str(Path(run_dir).resolve())
    if key in _HELD:
        return
    path = Path(run_dir) / _HELD_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = path.read_text().strip() if path.is_file() else ""
        os.close(fd)
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return
        raise ConfigError(
            f"trainer.run_dir={run_dir} is in use by another job ({holder or 'its holder unknown'})"
            ": wait for it to end, or give this one another trainer.run_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(
        fd,
        f"pid {os.getpid()} on {socket.gethostname()}, since "
        f"{dt.datetime.now().isoformat(timespec='seconds')}\n".encode(),
    )
    _HELD[key] = fd


@contextlib.contextmanager
def run_dirs_released() -> Iterator[None]:
    """The block of a job; the run dirs it held (`hold`) are let go after it, however it ended (a
    Python session goes on to its next job)."""
    try:
        yield
    finally:
        while _HELD:
            os.close(_HELD.popitem()[1])


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


# the file global rank 0 writes into the run dir for the other nodes' ranks to read
_SHARED_PROBE = ".ranks_see_this"


def check_shared(run_dir: Path, spans_nodes: bool, wait_s: float = 20.0) -> None:
    """A job over several nodes needs one run dir all of them see (every rank writes its checkpoint
    shard there, and the launcher reads the ranks' failure records): global rank 0 writes a file
    there, every rank reads it back (for up to `wait_s`: a network file system may show a new file
    late), and a rank that does not find it stops the job at once, on every rank, naming the nodes,
    rather than at the first checkpoint. Nothing to check on one node."""
    if not spans_nodes or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    probe = Path(run_dir) / _SHARED_PROBE
    token: list[Any] = [None]
    if dist.get_rank() == 0:
        token[0] = f"{socket.gethostname()} {os.getpid()} {time.time_ns()}"
        probe.write_text(token[0])
    dist.broadcast_object_list(token, src=0)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            seen = probe.read_text() == token[0]
        except OSError:
            seen = False
        if seen or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (seen, socket.gethostname()))
    if dist.get_rank() == 0:
        probe.unlink(missing_ok=True)
    blind = [(rank, host) for rank, (ok, host) in enumerate(everyone) if not ok]
    if blind:
        hosts = sorted({host for _, host in blind})
        raise ConfigError(
            f"the run dir {run_dir} is not one directory on every node: rank"
            f"{'s' if len(blind) > 1 else ''} {', '.join(str(r) for r, _ in blind)} (on "
            f"{', '.join(hosts)}) do{'es' if len(blind) == 1 else ''} not see the file rank 0 (on "
            f"{everyone[0][1]}) wrote there. Every rank writes its share of each checkpoint "
            "into it: give trainer.run_dir / trainer.output_dir a directory every node mounts "
            "(NFS, Lustre, a ReadWriteMany volume)"
        )


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
