"""One rank's life (`run_rank`): its threads, process group and device, its run dir, hang watchdog
and NCCL flight recorder, the mesh, then the job's entry; whatever happens, its loader workers end
with it, and a failure leaves its record (`visiondist.faults.failures`). `elastic_worker` and
`pod_worker` are what torch's elastic agent starts in each process (`launch/ranks.py`).

What only a rank needs (the mesh and DTensor, the loader workers, the failure records) is imported
where the rank needs it (`# noqa: PLC0415 (rank-side)`).
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from visiondist.config import from_container
from visiondist.config.layout import RunLayout
from visiondist.engine.precision import set_tf32
from visiondist.launch.failed import record_rank_failure, wait_for_the_launcher_after_a_lost_peer
from visiondist.launch.rundir import (
    STATELESS,
    _shared_run_dir,
    _write_plan,
    check_shared,
    run_kind,
)
from visiondist.plan import cuda_device_count, resolve
from visiondist.plan.fit import as_run
from visiondist.plan.world import backend_for, cuda_index
from visiondist.utils.exit import leave_quickly_when_done
from visiondist.utils.heartbeat import PROGRESS
from visiondist.utils.procenv import omp_threads, ranks_sharing_cpus, threads_per_rank
from visiondist.utils.signals import HANG_DIR, RANK_ENV, RUN_DIR_ENV, STOP, StopNow

log = logging.getLogger(__name__)

Entry = Callable[[DictConfig, Any, Path], Any]


def _set_threads(local_world: int) -> None:
    """Split this process's CPUs (affinity and container quota) between the ranks of a node unless
    the user chose (OMP_NUM_THREADS). Set here, not left to torch's reading of OMP_NUM_THREADS: a
    rank forked from its launcher inherits the launcher's count, read before the launcher knew how
    many ranks it would start."""
    threads = omp_threads()
    if threads is None and "OMP_NUM_THREADS" in os.environ:
        # a nested list: OpenMP read it as this rank loaded it (spawned, or forked from a fresh fork
        # server)
        return
    torch.set_num_threads(threads or threads_per_rank(ranks_sharing_cpus(local_world)))


def _init_rank(
    run: RunLayout, single: bool, startup_timeout_s: float = 1800.0, tf32: bool = True
) -> tuple[torch.device, int]:
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    _set_threads(run.per_node)
    device_id = None
    backend = backend_for(run.accelerator, run.share_gpu)
    if run.accelerator == "cuda":
        device = torch.device(
            "cuda", cuda_index(local_rank, torch.cuda.device_count(), run.share_gpu)
        )
        torch.cuda.set_device(device)
        device_id = device if backend == "nccl" else None
        set_tf32(tf32)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # shortened to trainer.dist_timeout_s after the first step
        timeout = timedelta(seconds=startup_timeout_s)
        # device_id (NCCL): the communicator is created now, and mesh sub-groups split from it
        # instead of each building its own
        if single:  # one process: an in-memory store, no ports
            dist.init_process_group(
                backend,
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=timeout,
                device_id=device_id,
            )
        else:
            dist.init_process_group(
                backend, init_method="env://", timeout=timeout, device_id=device_id
            )
    return device, local_rank


def run_rank(
    entry: Entry,
    cfg_dict: dict,
    run: RunLayout,
    run_dir: Optional[str],
    auto_plan: Any = None,
    top_level: bool = False,
) -> Any:
    """Body of every rank: process group, device, mesh, then `entry`. Whatever happens, the rank's
    loader workers end with it; a failure leaves `<run>/failure/rank<k>.txt` (see
    `visiondist.faults.failures`). `top_level`: this process is what the user started (one rank, or
    a torchrun / srun task), so a hang's line is printed here."""
    from visiondist.data.workers import close_loaders  # noqa: PLC0415 (rank-side)
    from visiondist.faults.failures import rank_errors  # noqa: PLC0415 (rank-side)
    from visiondist.parallel import build_layout  # noqa: PLC0415 (rank-side)

    # what a run dir this rank creates records (config.yaml: the run as asked)
    asked = from_container(cfg_dict)
    cfg = as_run(asked, run)  # a named layout fitted by accumulation: the run's trainer.grad_accum
    # resolved once, in the launching process: nothing below changes it
    OmegaConf.set_readonly(cfg, True)
    PROGRESS.reset(cfg.trainer.startup_timeout_s)
    if run_dir is not None:
        _flight_recorder(Path(run_dir), run.accelerator)
    # from the start: a stop asked for while the process group forms is still a stop; one voice per
    # job: this process when it is what the user started (global rank 0 of it), else the launcher
    # (`launch.stop`)
    signals = STOP.install(
        at_once=run_kind(entry) in STATELESS, speak=top_level and os.environ.get("RANK", "0") == "0"
    )
    # torch wraps sys.excepthook at each init_process_group ("[rank0]: " on every line, once more
    # for each run a Python session starts in-process): the process's own is put back at the end
    excepthook = sys.excepthook
    device, local_rank = _init_rank(
        run,
        single=run.world_size == 1 and not run.under_torchrun,
        startup_timeout_s=cfg.trainer.startup_timeout_s,
        tf32=cfg.trainer.tf32,
    )
    path, watchdog = (Path(run_dir) if run_dir else None), None
    try:
        path = path or _shared_run_dir(asked, run, run_kind(entry))
        check_shared(path, spans_nodes=run.per_node < run.world_size)
        watchdog = _start_watchdog(path, top_level)
        if auto_plan is not None and run_dir is None and dist.get_rank() == 0:
            _write_plan(path, auto_plan)
        layout = build_layout(run.dp, run.tp, run.pp, device, local_rank, run=run)
        return entry(cfg, layout, path)
    # a second signal, or an evaluation's first: this rank leaves now, unsaved
    except StopNow as stop:
        return _stopped_now(stop.signal_name, path)
    except rank_errors() as exc:
        # a peer that left at once
        if STOP.received is not None and (STOP.at_once or STOP.count > 1):
            return _stopped_now(STOP.received, path)
        wait_for_the_launcher_after_a_lost_peer(record_rank_failure(path, exc, cfg, run), STOP)
        raise
    finally:
        if watchdog is not None:
            watchdog.stop()
        close_loaders()
        signals.restore(ignore=not top_level)  # a spawned rank: its launcher takes any later signal
        dist.destroy_process_group()
        sys.excepthook = excepthook


def _stopped_now(signal_name: str, run_dir: Optional[Path]) -> dict:
    return {
        "stopped at step": PROGRESS.step,
        "stopped by": signal_name,
        "at once": True,
        "run dir": str(run_dir),
    }


def _flight_recorder(run_dir: Path, accelerator: str) -> None:
    """NCCL: keep a trace of the last collectives and dump it into `<run>/hang/` when one times out
    (torch's flight recorder). Set before the process group exists; a user's own settings win."""
    if accelerator != "cuda":
        return
    from visiondist.compat import flight_recorder_env  # noqa: PLC0415 (rank-side)

    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:  # the old name, set by the user, is theirs
        os.environ.setdefault(flight_recorder_env(), "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ:
        (run_dir / HANG_DIR).mkdir(exist_ok=True)
        os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(run_dir / HANG_DIR / "nccl_trace_rank_")


def _start_watchdog(run_dir: Path, top_level: bool):
    """The rank's hang watchdog; the loader workers it starts later learn the run dir from the
    environment."""
    from visiondist.data.workers import worker_pids  # noqa: PLC0415 (rank-side)
    from visiondist.faults.failures import EXIT_HANG, Watchdog  # noqa: PLC0415 (rank-side)

    os.environ[RUN_DIR_ENV], os.environ[RANK_ENV] = str(run_dir), str(dist.get_rank())

    # the main thread is stuck: leave without it (the workers die with us)
    def end_rank(line: str) -> None:
        if top_level:
            print(f"error: {line}", file=sys.stderr, flush=True)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_HANG)

    return Watchdog(run_dir, dist.get_rank(), worker_pids, end_rank).start()


@record  # a failing rank's traceback reaches the launcher's error report, not just its exit code
def elastic_worker(entry: Entry, cfg_dict: dict, run: RunLayout, run_dir: str) -> Any:
    done = leave_quickly_when_done()
    result = run_rank(entry, cfg_dict, run, run_dir)
    done()
    return result


@record
def pod_worker(entry: Entry, cfg_dict: dict) -> Any:
    """A rank of a pod's node (`launch_pod`): it resolves the layout from the world the rendezvous
    made (an elastic job's node count is known only then), as a rank under torchrun does, and finds
    the run dir with its peers."""
    done = leave_quickly_when_done()
    run, auto_plan = resolve(
        from_container(cfg_dict),
        dict(os.environ),
        cuda_device_count(),
        training=run_kind(entry) not in STATELESS,
    )
    result = run_rank(entry, cfg_dict, run, None, auto_plan)
    done()
    return result


def inductor_cache_dir() -> Path:
    """Where compiled blocks are cached across runs: `$XDG_CACHE_HOME/visiondist/inductor` (else
    ~/.cache/...)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "visiondist" / "inductor"
