"""The elastic agent that starts a node's ranks (`spawn_ranks`): on this machine alone
(`spawn_local`, a c10d rendezvous on a free localhost port), or as one node of a pod's job
(`visiondist.launch.pods`); its own log lines kept quiet (`_quiet_agent`), since the launcher says
what happened in one line.

torch's elastic agent and its rendezvous (30-60 ms, with visiondist.compat's adjustments of them)
are imported when ranks are spawned: a job of one rank never starts the agent
(`# noqa: PLC0415 (the agent)`)."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import rich
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from visiondist.launch.pods import PodJob
from visiondist.utils.logs import held_at
from visiondist.utils.procenv import (
    WAIT_RECORD,
    environment_kept,
    omp_threads,
    ranks_share_cpus,
    threads_per_rank,
)


@contextmanager
def _quiet_agent():
    """The elastic agent's own warnings and its failure table repeat what `RunFailed` or
    `JobStopped` says in one line."""
    # its modules' loggers exist from here on
    import torch.distributed.launcher.api  # noqa: F401,PLC0415 (the agent)

    # torch sets the level of each of its modules' loggers
    names = [
        name
        for name in logging.root.manager.loggerDict
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing.spawn"))
    ]
    with held_at(
        logging.CRITICAL, ("torch.distributed.elastic", "torch.multiprocessing.spawn", *names)
    ):
        yield


_TRACKER_QUIET = "ignore:resource_tracker:UserWarning"


def spawn_local(
    fn: Callable, nprocs: int, *args: Any, max_restarts: int = 0, cuda: bool = True
) -> dict[int, Any]:
    """Run `fn(*args)` in `nprocs` fresh processes on this machine through torch's elastic launcher
    (c10d rendezvous on a free localhost port); each sees RANK / WORLD_SIZE / MASTER_* in its
    environment. After a rank fails, every rank is restarted up to `max_restarts` times. Returns
    every rank's return value; a failing rank raises here with its traceback. `cuda=False`: the
    ranks will not use a GPU (`start_method`).

    Args:
        fn: what each rank runs (a module-level function: spawned ranks import it).
        nprocs: the ranks to start.
        *args: `fn`'s arguments, the same for every rank.
        max_restarts: how many times every rank is restarted after one fails.
        cuda: the ranks use a GPU (they are spawned, not forked).

    Returns:
        Each rank's return value, by rank.
    """
    return spawn_ranks(fn, nprocs, *args, max_restarts=max_restarts, cuda=cuda)


def start_method(cuda: bool, threads: Optional[int]) -> str:
    """How the agent starts the ranks, each running `threads` intra-op threads (None: not one count,
    e.g. a nested OMP_NUM_THREADS list).

    - On a GPU: spawned. A process that touched CUDA cannot hand it to a forked child.
    - On the CPU with one thread a rank: forked from this process (unless it ran autograd off the
      CPU, which a forked child cannot survive: `autograd_survives_fork`; then as below), once it
      has imported what the ranks import (`_preload`: torchvision, the ranks' modules). No rank
      imports anything again, and no second interpreter starts: a 2-rank tiny run took 7.0-8.3 s of
      CPU this way, 11.0-12.4 s from a fork server (2 cores). A single-threaded rank never starts an
      OpenMP team, so it does not matter what OpenMP did in this process before the fork, nor how
      OpenMP's threads wait.
    - On the CPU with several threads a rank: forked from a fork server (multiprocessing's
      `forkserver`, preloaded the same way) that started afresh. libgomp's thread pool does not
      survive a fork: a child of a process that ran a parallel region hangs in its own first one. A
      fresh server also loads OpenMP with the ranks' environment (`OMP_WAIT_POLICY`, read once when
      torch loads)."""
    if cuda:
        return "spawn"
    return "fork" if threads == 1 else "forkserver"


def autograd_survives_fork() -> bool:
    """Whether a child forked from this process can run a backward. Not once this process has run
    one off the CPU (on fake tensors too, as `tools/plan.py verify=` measures a layout's step): that
    starts autograd's device threads, and every forked child then refuses a backward ("Unable to
    handle autograd's threading in combination with fork-based multiprocessing"). Asked of a child
    forked for the purpose, which runs one tiny backward: a few milliseconds a launch."""
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's (atexit, buffers) runs on its way out
        code = 1
        try:
            probe = torch.ones(1, requires_grad=True)
            probe.sum().backward()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _rank_modules(fn: Callable, args: tuple) -> list[str]:
    """What the ranks import once started: torch, torchvision, the modules of `fn` and of the
    functions among `args` (the entry a rank runs), and what those modules list in `RANK_IMPORTS`
    (e.g. the loaders' augmentation library)."""
    modules = sorted(
        {m for f in (fn, *args) if callable(f) and (m := getattr(f, "__module__", None))}
        - {"__main__"}
    )
    extra = [
        name for m in modules for name in getattr(importlib.import_module(m), "RANK_IMPORTS", ())
    ]
    return ["torch", "torchvision", *modules, *extra]


def _preload(method: str, fn: Callable, args: tuple) -> None:
    """Import what the ranks import before they start: here, for ranks forked from this process; in
    the fork server (with this process's `__main__`), for ranks forked from it."""
    modules = _rank_modules(fn, args)
    if method == "fork":
        for name in modules:
            importlib.import_module(name)
    elif method == "forkserver":
        multiprocessing.set_forkserver_preload(["__main__", *modules])


# how long a rank whose launcher is gone may take to finish its stop (`_launcher_watch`): the
# launcher's own wait after a stop signal, which it sets for its ranks
STOP_GRACE_ENV = "VISIONDIST_STOP_GRACE_S"


def _watched(fn: Callable, *args: Any) -> Any:
    """A rank's `fn(*args)` that ends its process once its launcher is gone (`_launcher_watch`)."""
    done = _launcher_watch(float(os.environ.get(STOP_GRACE_ENV, "600")))
    try:
        return fn(*args)
    finally:
        done.set()


def _launcher_watch(grace_s: float) -> threading.Event:
    """A rank outlives a launcher killed outright (SIGKILL: the out-of-memory killer, a scheduler)
    unless it ends itself. torch asks the rank to stop when its parent dies (SIGINT, by
    PR_SET_PDEATHSIG), and the rank stops at its next step boundary with a checkpoint; but then
    torch's wrapper of the rank waits for the launcher to read its return value, forever. This
    thread ends the process once its launcher is gone and the rank has returned (the event set), or
    `grace_s` after the launcher went, whichever comes first (exit code 130, a stop by SIGINT). Its
    loader workers end with it (`visiondist.data.workers`)."""
    launcher = os.getppid()
    done = threading.Event()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(1.0)
        done.wait(grace_s)
        os._exit(128 + signal.SIGINT)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
    return done


def _as_spawned(fn: Callable, *args: Any) -> Any:
    """A forked rank (from this process or from the fork server) starts as a spawned rank does:
    - its own processes (loader workers) are forked from the rank, so that they inherit its imports
      (a spawned worker imports torch again, about 3 s) and end with it (torch's loader workers
      watch their parent process). Left to multiprocessing, a child of the fork server would start
      them through a fork server of its own, whose children outlive a killed rank;
    - with Python's own handlers of the stop signals, not this process's (the launcher's stop, the
      agent's);
    - writing plain text, not a notebook's displays: a rank forked from a Jupyter kernel cannot
      send them (the kernel drops a fork's messages); the kernel draws the training bar
      (`visiondist.observe.progress`)."""
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    multiprocessing.set_start_method("fork", force=True)
    tempfile.tempdir = _OUTER_TEMPDIR[0]  # a rank's temporary files are not the launch's
    if rich.get_console().is_jupyter:  # forked from a notebook's kernel, whose displays are its own
        # plain text as into a pipe: lines not cut at a pipe's 80 columns
        rich.reconfigure(force_jupyter=False, force_terminal=False, soft_wrap=True, width=120)
    return _watched(fn, *args)


def spawn_ranks(
    fn: Callable,
    nprocs: int,
    *args: Any,
    max_restarts: int = 0,
    pod: Optional[PodJob] = None,
    cuda: bool = True,
) -> dict[int, Any]:
    """`spawn_local`, or with `pod` this node's ranks of a job of several nodes (its rendezvous);
    the return values are keyed by global rank."""
    with _ranks_environment(nprocs):
        return _launch(fn, nprocs, args, max_restarts, pod, cuda)


# what `_ranks_environment` sets for the ranks
RANKS_ENVIRONMENT = (
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    WAIT_RECORD,
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
)


@contextmanager
def _ranks_environment(nprocs: int) -> Iterator[None]:
    """The environment the ranks start with, this process's own put back after them: a notebook's
    next run of one rank keeps this process's threads and its OpenMP waiting."""
    with environment_kept(RANKS_ENVIRONMENT):
        # the ranks' threads share this process's CPUs (affinity and container quota), and wait
        # passively where there are several; the rest of `visiondist.utils.procenv`'s environment
        # was set when visiondist was imported
        os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nprocs)))
        ranks_share_cpus(nprocs)
        # Each restart gets a fresh store for the ranks' process group: with the rendezvous store
        # shared, a restarted rank can read a peer address left by the previous attempt
        # (pytorch/pytorch#135712).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        yield


def _launch(
    fn: Callable,
    nprocs: int,
    args: tuple[Any, ...],
    max_restarts: int,
    pod: Optional[PodJob],
    cuda: bool,
) -> dict[int, Any]:
    from torch.distributed.elastic.multiprocessing import (  # noqa: PLC0415 (the agent)
        DefaultLogsSpecs,
    )
    from torch.distributed.launcher.api import (  # noqa: PLC0415 (the agent)
        LaunchConfig,
        elastic_launch,
    )

    from visiondist.compat import (  # noqa: PLC0415 (the agent)
        agent_signals,
        announced_restarts,
        quick_rendezvous_names,
    )

    quick_rendezvous_names()  # over a second of every launch (visiondist.compat)

    # Ranks ended at once (a stop that outlasted trainer.stop_timeout_s) leave their loader queues'
    # semaphores to multiprocessing's resource tracker, which frees them and would print a "leaked
    # semaphore" warning after the job's last line; the tracker takes this process's -W options when
    # it starts.
    if _TRACKER_QUIET not in sys.warnoptions:
        sys.warnoptions.append(_TRACKER_QUIET)
    rdzv: dict[str, Any]
    if pod is None:
        rdzv = dict(
            min_nodes=1,
            max_nodes=1,
            run_id=f"visiondist-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
        )
    else:
        rdzv = dict(
            min_nodes=pod.min_nodes,
            max_nodes=pod.max_nodes,
            run_id=pod.run_id,
            rdzv_backend=pod.rdzv_backend,
            rdzv_endpoint=pod.rdzv_endpoint,
            rdzv_configs={"rank": pod.node_rank} if pod.node_rank is not None else {},
        )
    method = start_method(cuda, omp_threads())
    if method == "fork" and not autograd_survives_fork():
        # this process ran autograd off the CPU: its forked children could not train
        method = "forkserver"
        print(
            "the ranks start from a fresh fork server, not forked from this process: it ran "
            "autograd off the CPU (a GPU, or a layout's check on fake tensors), which a forked "
            "rank cannot survive (about 3 s more to start)",
            flush=True,
        )
    # SIGTERM / SIGINT: launch.stop's
    signals: dict[str, Any] = agent_signals({f.name for f in dataclasses.fields(LaunchConfig)})
    say = lambda line: print(line, flush=True)  # noqa: E731 (the launcher's lines)
    # The agent's per-attempt error files (what `_every_report` reads) and the tracebacks torch's
    # process starter has each rank write (`pytorch-errorfile-*.pickle`) live for the launch
    # only: left to their defaults they stay in the temp dir after every job (a failed one). This
    # process's own multiprocessing directory (the fork server's socket, which outlives the launch
    # in a notebook) is made first, where it belongs; the ranks get the temp dir back
    # (`_as_spawned`).
    multiprocessing.util.get_temp_dir()
    with (
        tempfile.TemporaryDirectory(prefix="visiondist-ranks-", ignore_cleanup_errors=True) as d,
        _temp_dir(d),
    ):
        config = LaunchConfig(
            nproc_per_node=nprocs,
            **rdzv,
            max_restarts=max_restarts,
            monitor_interval=0.1,
            start_method=method,
            logs_specs=DefaultLogsSpecs(log_dir=d),
            **signals,
        )
        try:
            with announced_restarts(say):
                if method == "spawn":
                    return elastic_launch(config, _watched)(fn, *args)
                _preload(method, fn, args)
                return elastic_launch(config, _as_spawned)(fn, *args)
        except ChildFailedError as exc:
            raise _every_report(exc) from None


# the temp dir of the process that launches the ranks, before `_temp_dir`: what a forked rank
# restores
_OUTER_TEMPDIR: list[Optional[str]] = [None]


@contextmanager
def _temp_dir(path: str) -> Iterator[None]:
    """`tempfile`'s directory is `path` in this process for the block."""
    _OUTER_TEMPDIR[0] = tempfile.tempdir
    tempfile.tempdir = path
    try:
        yield
    finally:
        tempfile.tempdir = _OUTER_TEMPDIR[0]


def _every_report(exc: Any) -> Any:
    """The elastic agent reports the first rank it saw end, which is often a peer that lost its
    connection to the rank that failed (gloo's peers fail on its closed socket at once); the failing
    rank's own report was written beside it, in its error file of this attempt. The returned error
    names every rank that left one."""
    failures = dict(exc.failures)
    for rank, seen in exc.failures.items():
        if not seen.error_file or seen.error_file == os.devnull:
            continue
        # <run>/attempt_<n>/<local rank>/error.json
        attempt = os.path.dirname(os.path.dirname(seen.error_file))
        for local in (
            sorted(int(e) for e in os.listdir(attempt) if e.isdigit())
            if os.path.isdir(attempt)
            else []
        ):
            other, error_file = (
                rank - seen.local_rank + local,
                os.path.join(attempt, str(local), "error.json"),
            )
            if other not in failures and os.path.isfile(error_file):
                # it raised (its report is there); the agent then ended it, or it exited with code 1
                # first
                failures[other] = ProcessFailure(
                    local_rank=local, pid=-1, exitcode=1, error_file=error_file
                )
    return exc if len(failures) == len(exc.failures) else ChildFailedError(exc.name, failures)
