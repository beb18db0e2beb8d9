"""Loader worker processes: how they start, and how a rank makes sure none outlives it.

Workers ignore SIGTERM / SIGINT: a signal to the whole process group (Ctrl-C, SLURM's time-limit
warning) is for the rank, which checkpoints and then stops its workers itself. Because of that,
nothing may rely on SIGTERM to end a worker: multiprocessing's exit handler does exactly that
(terminate, then join without a timeout) and would wait forever. So

- every worker dies with its rank (`PR_SET_PDEATHSIG`: the kernel sends it SIGKILL when the rank's
  process ends, however it ends, OOM killer included);
- `close_loaders()` runs on every exit of a rank, error or not, and ends each loader's workers at
  once (a worker stuck in `__getitem__` included).

A worker that dies (the OOM killer) surfaces in the rank as torch's "DataLoader worker ... killed by
signal", or, when the rank was receiving a batch whose memory the dead worker still had to hand
over, as a bare EOFError from multiprocessing: `watched` (around the training batches and the
evaluations' alike) turns the latter into the former.

How many: `loader_workers` makes `data.num_workers=-1` concrete from the cores this process may use.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.util
import os
import signal
import time
import weakref
from typing import Any, Iterator

import cv2
from torch.utils.data import DataLoader
from torch.utils.data._utils import signal_handling

from visiondist.utils.procenv import usable_cpus
from visiondist.utils.signals import ignore_stop_signals, install_worker_stack_dump

log = logging.getLogger(__name__)

_LOADERS: weakref.WeakSet[DataLoader] = weakref.WeakSet()
_PR_SET_PDEATHSIG = 1


def register(loader: DataLoader) -> DataLoader:
    """Track a loader with workers so that `close_loaders` can stop them.

    A worker hands each batch's memory to the rank through a socket in multiprocessing's temporary
    directory. Made here, that directory is the rank's, which its workers inherit and which goes
    with the rank; a worker's own would stay behind in the temp dir, since `close_loaders` kills
    the workers (two directories a worker, a job: thousands in a week of runs)."""
    if loader.num_workers > 0:
        multiprocessing.util.get_temp_dir()
        _LOADERS.add(loader)
    return loader


def worker_init(_worker_id: int) -> None:
    _die_with_parent()
    # loader workers are the parallelism; OpenCV's own threads would oversubscribe
    cv2.setNumThreads(1)
    # a signal to the whole process group must not kill a worker under its rank
    ignore_stop_signals()
    install_worker_stack_dump()


def _die_with_parent() -> None:
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # not Linux: the workers' own parent check still ends them when idle
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the rank ended before the request took effect
        os._exit(1)


def worker_pids() -> list[int]:
    """The live worker processes of this rank's loaders."""
    pids = []
    for loader in list(_LOADERS):
        for worker in getattr(getattr(loader, "_iterator", None), "_workers", []) or []:
            if worker.is_alive():
                pids.append(worker.pid)
    return pids


class watched:
    """A loader's batch iterator whose failures from a worker's death name the worker. A batch's
    tensors reach the rank through file descriptors its worker sends on request; a worker killed
    after queueing a batch leaves the rank an EOFError (or a reset connection) in place of them,
    before the worker's exit is seen. The dead worker is then waited for (up to 2 s) and named, with
    how it ended."""

    def __init__(self, batches: Iterator) -> None:
        self._batches = batches

    def __iter__(self) -> watched:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._batches)
        except (EOFError, ConnectionError) as exc:
            dead = _dead_workers(getattr(self._batches, "_workers", None) or [])
            if not dead:
                raise
            raise RuntimeError(
                f"DataLoader worker (pid(s) {', '.join(str(w.pid) for w in dead)}) exited "
                f"unexpectedly: {_how(dead[0].exitcode)}"
            ) from exc


def _dead_workers(workers: list, wait: float = 2.0) -> list:
    deadline = time.monotonic() + wait
    while True:
        dead = [w for w in workers if not w.is_alive()]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.02)


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = (
            " (what the kernel's OOM killer sends: lower data.num_workers or data.batch_size, or "
            "give the job more memory)"
            if -exitcode == signal.SIGKILL
            else ""
        )
        return f"killed by signal {name}{why}"
    return f"exit code {exitcode}"


def close_loaders() -> None:
    """End the workers of every tracked loader at once: the rank is done with them (a finished or
    stopped run, a failure). They are killed rather than asked to leave: a worker left to exit on
    its own took seconds to do so, seconds a stopped job waited for after its checkpoint was
    written. Their prefetched batches hold nothing that matters; the loader's own shutdown then
    closes its queues."""
    for loader in list(_LOADERS):
        iterator = getattr(loader, "_iterator", None)
        if iterator is None:
            continue
        workers = list(getattr(iterator, "_workers", []) or [])
        # a killed worker is not a failure of this loader
        if getattr(iterator, "_worker_pids_set", False):
            signal_handling._remove_worker_pids(id(iterator))
            iterator._worker_pids_set = False
        for worker in workers:
            if worker.is_alive():
                worker.kill()
        for worker in workers:
            worker.join(timeout=5)
        try:
            iterator._shutdown_workers()
        except Exception as exc:
            log.debug("loader shutdown: %s", exc)
        loader._iterator = None
    _LOADERS.clear()


AUTO_WORKERS_MAX = 16  # data.num_workers=-1: at most this many loader workers per rank


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity (a SLURM allocation, taskset) and its
    container's CPU quota, not the whole machine (`visiondist.utils.procenv.usable_cpus`)."""
    return usable_cpus()


def loader_workers(requested: int, ranks_per_node: int, cores: int | None = None) -> int:
    """`data.num_workers` made concrete on a rank: as given when >= 0; -1 (auto): what the CPUs this
    process may use (`usable_cores`) allow each of its node's `ranks_per_node` ranks, one for the
    rank's own work and the rest for its loader workers, at most `AUTO_WORKERS_MAX`; 0 (the rank
    loads its batches itself) where a rank has a single CPU or less."""
    if requested >= 0:
        return requested
    cores = usable_cores() if cores is None else cores
    return max(0, min(AUTO_WORKERS_MAX, cores // max(1, ranks_per_node) - 1))
