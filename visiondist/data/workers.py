"""Loader worker processes: how they start, and how a rank makes sure none outlives it.

Workers ignore SIGTERM / SIGINT: a signal to the whole process group (Ctrl-C, SLURM's time-limit warning) is for
the rank, which checkpoints and then stops its workers itself. Because of that, nothing may rely on SIGTERM to end
a worker: multiprocessing's exit handler does exactly that (terminate, then join without a timeout) and would wait
forever. So

- every worker dies with its rank (`PR_SET_PDEATHSIG`: the kernel sends it SIGKILL when the rank's process ends,
  however it ends, OOM killer included);
- `close_loaders()` runs on every exit of a rank, error or not, and ends each loader's workers at once (a worker
  stuck in `__getitem__` included).

How many: `loader_workers` makes `data.num_workers=-1` concrete from the cores this process may use.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import weakref

import cv2
from torch.utils.data import DataLoader

from visiondist.utils.signals import ignore_stop_signals, install_worker_stack_dump

log = logging.getLogger(__name__)

_LOADERS: "weakref.WeakSet[DataLoader]" = weakref.WeakSet()
_PR_SET_PDEATHSIG = 1


def register(loader: DataLoader) -> DataLoader:
    """Track a loader with workers so that `close_loaders` can stop them."""
    if loader.num_workers > 0:
        _LOADERS.add(loader)
    return loader


def worker_init(_worker_id: int) -> None:
    _die_with_parent()
    cv2.setNumThreads(1)  # loader workers are the parallelism; OpenCV's own threads would oversubscribe
    ignore_stop_signals()  # a signal to the whole process group must not kill a worker under its rank
    install_worker_stack_dump()


def _die_with_parent() -> None:
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the workers' own parent check still ends them when idle
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


def close_loaders() -> None:
    """End the workers of every tracked loader at once: the rank is done with them (a finished or stopped run, a
    failure). They are killed rather than asked to leave: a worker left to exit on its own took seconds to do so,
    seconds a stopped job waited for after its checkpoint was written. Their prefetched batches hold nothing that
    matters; the loader's own shutdown then closes its queues."""
    from torch.utils.data._utils import signal_handling

    for loader in list(_LOADERS):
        iterator = getattr(loader, "_iterator", None)
        if iterator is None:
            continue
        workers = list(getattr(iterator, "_workers", []) or [])
        if getattr(iterator, "_worker_pids_set", False):  # a killed worker is not a failure of this loader
            signal_handling._remove_worker_pids(id(iterator))
            iterator._worker_pids_set = False
        for worker in workers:
            if worker.is_alive():
                worker.kill()
        for worker in workers:
            worker.join(timeout=5)
        try:
            iterator._shutdown_workers()
        except Exception as exc:  # noqa: BLE001 - a broken queue must not keep the rank alive
            log.debug("loader shutdown: %s", exc)
        loader._iterator = None
    _LOADERS.clear()


AUTO_WORKERS_MAX = 16  # data.num_workers=-1: at most this many loader workers per rank


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a SLURM allocation or taskset, not the whole machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def loader_workers(requested: int, ranks_per_node: int, cores: int | None = None) -> int:
    """`data.num_workers` made concrete on a rank: as given when >= 0; -1 (auto): what the node's cores allow each of
    its `ranks_per_node` ranks, one core for the rank's own work and the rest for its loader workers, at most
    `AUTO_WORKERS_MAX`; 0 (the rank loads its batches itself) where a rank has a single core or less."""
    if requested >= 0:
        return requested
    cores = usable_cores() if cores is None else cores
    return max(0, min(AUTO_WORKERS_MAX, cores // max(1, ranks_per_node) - 1))
