"""Starting the ranks of a job (`launch`): self-launched through torch's elastic launcher, or joined
under torchrun / srun; each rank's set-up (`run_rank`: process group, device, threads, run dir,
watchdog, failure records), and a stopped job's one line (a failed job's:
`visiondist.launch.failed`).

The launching process imports this module to plan and start a job: what only a rank needs (the
mesh and DTensor, the loader workers and OpenCV, torch's elastic rendezvous, the failure records and
their rich console) is imported where a rank needs it (`# noqa: PLC0415 (rank-side)`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, cast

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import record

from visiondist.config import from_container, to_container
from visiondist.config.layout import RunLayout
from visiondist.engine.precision import set_tf32
from visiondist.engine.run import ELSEWHERE
from visiondist.launch.estimate import check_gpu_layout
from visiondist.launch.failed import (
    one_line_failure,
    record_rank_failure,
    wait_for_the_launcher_after_a_lost_peer,
)
from visiondist.launch.pods import PodJob, pod_job, pod_ranks
from visiondist.launch.rundir import STATELESS, _shared_run_dir, _write_plan, new_run_dir, run_kind
from visiondist.launch.shared import shared_gpu_line
from visiondist.launch.slurm import slurm_env
from visiondist.launch.spawn import STOP_GRACE_ENV, _quiet_agent, spawn_local, spawn_ranks
from visiondist.launch.stop import JobStopped, LauncherStop, grace_seconds, stopped_line
from visiondist.observe.progress import drawn_from_feed, in_notebook
from visiondist.plan import announce, cuda_device_count, resolve
from visiondist.plan.compiling import compile_plan
from visiondist.plan.fit import as_run
from visiondist.plan.world import (
    backend_for,
    cuda_index,
    device_memory_gb,
    under_torchrun,
)
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
    device, local_rank = _init_rank(
        run,
        single=run.world_size == 1 and not run.under_torchrun,
        startup_timeout_s=cfg.trainer.startup_timeout_s,
        tf32=cfg.trainer.tf32,
    )
    path, watchdog = (Path(run_dir) if run_dir else None), None
    try:
        path = path or _shared_run_dir(asked, run, run_kind(entry))
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
def _elastic_worker(entry: Entry, cfg_dict: dict, run: RunLayout, run_dir: str) -> Any:
    done = leave_quickly_when_done()
    result = run_rank(entry, cfg_dict, run, run_dir)
    done()
    return result


@record
def _pod_worker(entry: Entry, cfg_dict: dict) -> Any:
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


def launch(
    entry: Entry,
    cfg: DictConfig,
    env: Optional[dict] = None,
    results: Optional[dict[int, Any]] = None,
) -> RunLayout:
    """Resolve the layout (once, here), then run `entry` on every rank. Errors surface before any
    spawn.

    Args:
        entry: what every rank runs, `entry(cfg, layout, run_dir)` (e.g. `train.run.train`); its
            `run_kind` attribute ("eval", "predict", "benchmark") names the kind of job.
        cfg: the job's config, composed and checked (`visiondist.cli.load_config`).
        env: the environment the layout is resolved from (torchrun's, SLURM's, a pod's
            variables); None: this process's, with srun's tasks' variables translated into it.
        results: filled with what `entry` returned, by global rank (the ranks this process
            started or ran; under torchrun its own), also when the job stopped.

    Returns:
        The resolved layout the job ran with.

    Raises:
        ConfigError: the layout cannot run here (before any rank starts).
        RunFailed: a rank failed (its one line).
        JobStopped: a stop signal ended the job (what was kept, how to go on).
    """
    # srun's tasks become a torch.distributed job (init_process_group reads os.environ)
    if env is None:
        os.environ.update(slurm_env(os.environ))
    env = dict(os.environ) if env is None else env
    pod = None if under_torchrun(env) else pod_job(env)
    if pod is not None:
        return launch_pod(entry, cfg, pod)
    kind = run_kind(entry)
    # an evaluation holds no training state: a named layout is not fitted for it (nor refused)
    stateless = kind in STATELESS
    run, auto_plan = resolve(
        cfg, env, cuda_device_count(), fit_named=not stateless, training=not stateless
    )
    main = env.get("RANK", "0") == "0"
    _say_before_launch(cfg, run, auto_plan, main, kind)
    cfg_dict = with_decode_choice(cfg, run, to_container(cfg), main)
    results = {} if results is None else results
    # torchrun or srun: this process is one rank; a stopped rank exits 128 + signal
    if run.under_torchrun:
        with one_line_failure(None):
            rank = int(env.get("RANK", "0"))
            results[rank] = run_rank(entry, cfg_dict, run, None, auto_plan, top_level=True)
            _report_stop(results[rank], kind, True)
        return run
    run_dir = new_run_dir(cfg, run, kind)
    if auto_plan is not None:
        _write_plan(run_dir, auto_plan)
    if run.world_size == 1:
        with one_line_failure(run_dir):
            results[0] = run_rank(entry, cfg_dict, run, str(run_dir), top_level=True)
            _report_stop(results[0], kind)
        return run

    # a notebook's training bar: drawn by this kernel from rank 0's feed (`observe.progress`)
    notebook = kind is None and cfg.trainer.progress and in_notebook()
    with drawn_from_feed(run_dir / "progress.feed" if notebook else None):
        _run_agent(
            lambda: spawn_local(
                _elastic_worker,
                run.per_node,
                entry,
                cfg_dict,
                run,
                str(run_dir),
                max_restarts=cfg.trainer.max_restarts,
                cuda=run.accelerator == "cuda",
            ),
            cfg,
            run,
            kind,
            run_dir,
            results=results,
        )
    return run


def _say_before_launch(
    cfg: DictConfig, run: RunLayout, auto_plan: Any, main: bool, kind: Optional[str]
) -> None:
    """What the launching process says of the resolved layout before any rank starts (`main`: the
    process of global rank 0 says it): a named layout's fit, a refused CPU layout, FSDP over one
    rank, a shared GPU, parallel=auto's choice, trainer.compile=auto's choice; and Inductor's
    caches kept across runs. `kind`: the entry's `run_kind`."""
    stateless = kind in STATELESS
    # a named layout over the device's budget (visiondist.plan.fit)
    if run.fitted and main:
        print(run.fitted, flush=True)
    # several ranks, no GPU found under accelerator=auto: stop, estimated
    check_gpu_layout(cfg, run, kind)
    if run.fsdp and run.dp == 1 and main:
        print(
            "warning: FSDP over 1 rank shards nothing (it runs as one process would): give the "
            "ranks, e.g. trainer.devices=2 or parallel.dp=2",
            flush=True,
        )
    # a test of correctness: said, and its memory summed
    if run.share_gpu and main:
        print(shared_gpu_line(cfg, run, device_memory_gb("cuda", 1)), flush=True)
    # an evaluation on plain DDP: nothing chosen to say
    plain = auto_plan is None or auto_plan.plain_ddp
    if run.chosen_by == "parallel=auto" and not (stateless and plain) and main:
        announce(cfg, run, auto_plan)
    # Inductor's caches (FX graphs, autograd, kernels) kept across runs, not in /tmp
    if run.compile:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
    if cfg.trainer.compile == "auto" and run.accelerator == "cuda" and main:
        print(
            f"trainer.compile=auto: {'compiling' if run.compile else 'not compiling'}: "
            f"{compile_plan(cfg, run)[3]}",
            flush=True,
        )


def with_decode_choice(cfg: DictConfig, run: RunLayout, cfg_dict: dict, main: bool) -> dict:
    """The ranks' config with `data.decode_on=auto` made concrete for this node
    (`visiondist.data.decode_choice`), the choice and its figures printed by the main process on a
    GPU; the run dir's config.yaml keeps `auto`, as asked."""
    if str(cfg.data.get("decode_on", "loader")) != "auto":
        return cfg_dict
    # OpenCV (16 ms) comes with it, which a launch without data.decode_on=auto never needs
    from visiondist.data.decode_choice import decode_plan  # noqa: PLC0415 (OpenCV, 16 ms)

    choice, why = decode_plan(cfg, run)
    # on the CPU auto is the loader, as it always was: nothing to say
    if main and run.accelerator == "cuda":
        print(f"data.decode_on=auto: {why}", flush=True)
    cfg_dict["data"]["decode_on"] = choice
    return cfg_dict


def _run_agent(
    spawn: Callable[[], dict[int, Any]],
    cfg: DictConfig,
    run: RunLayout,
    kind: Optional[str],
    run_dir: Optional[Path],
    under_torchrun: bool = False,
    results: Optional[dict[int, Any]] = None,
) -> None:
    """`spawn()` (the elastic agent and this node's ranks) under the launcher's stop handling: a
    failed rank's one line, a stop's last line (from the lowest global rank's result, or from the
    run dir when the ranks were ended: module visiondist.launch.stop). `run_dir` None: a pod's run
    dir, which its ranks chose. `results`: filled with the ranks' return values."""
    stop = LauncherStop(*_stop_wait(cfg, run, kind), kind=kind)
    # a rank whose launcher is killed outright stops within the launcher's own wait
    os.environ[STOP_GRACE_ENV] = str(stop.grace_s)
    try:
        with one_line_failure(run_dir, stop), _quiet_agent(), stop:
            returned = spawn()
        if results is not None:
            results.update(returned)
        _report_stop(_speaking(returned), kind, under_torchrun)
    except SignalException as exc:  # the ranks were ended before they finished
        name = stop.received or signal.Signals(exc.sigval).name
        why = stop.why() if stop.ended else ""
        if run_dir is None:
            raise JobStopped(
                name, f"stopped by {name}: the ranks were ended ({why or 'the agent was stopped'})"
            ) from None
        raise JobStopped(
            name, stopped_line(name, run_dir, kind, why=why, under_torchrun=under_torchrun)
        ) from None


def _speaking(returned: dict[int, Any]) -> Any:
    """The result the job's last line is made from: the lowest rank's, or for a stop a callback
    asked for, the rank whose callback asked (its reason)."""
    if not returned:
        return None
    asked = [
        result
        for result in returned.values()
        if isinstance(result, dict) and ELSEWHERE not in result.get("stopped because", ELSEWHERE)
    ]
    return asked[0] if asked else returned[min(returned)]


def launch_pod(entry: Entry, cfg: DictConfig, pod: PodJob) -> RunLayout:
    """This pod is one node of a Kubernetes job (`visiondist.launch.pods`): start its ranks through
    torch's elastic agent, as torchrun would, but with this project's stop handling (SIGTERM: every
    rank of every pod finishes its step and checkpoints, within trainer.stop_timeout_s). The layout
    is checked here for the largest node count (errors before any rank starts), and resolved by each
    rank for the world the rendezvous made."""
    kind = run_kind(entry)
    per_node = pod_ranks(cfg, pod, cuda_device_count())
    # restarts are the agent's, as torchrun's
    ranks_cfg = cast(DictConfig, OmegaConf.merge(cfg, {"trainer": {"max_restarts": 0}}))
    world = {
        "WORLD_SIZE": str(per_node * pod.max_nodes),
        "LOCAL_WORLD_SIZE": str(per_node),
        "LOCAL_RANK": "0",
    }
    run, _ = resolve(ranks_cfg, world, cuda_device_count(), training=kind not in STATELESS)
    check_gpu_layout(cfg, run, kind)
    print(pod.line() + f" ({per_node} per pod)", flush=True)
    if run.fitted and pod.node_rank in (0, None):
        print(run.fitted, flush=True)
    run_dir = Path(cfg.trainer.run_dir).expanduser() if cfg.trainer.run_dir else None
    restarts = cfg.trainer.max_restarts if pod.max_restarts is None else pod.max_restarts
    ranks_dict = with_decode_choice(
        ranks_cfg, run, to_container(ranks_cfg), pod.node_rank in (0, None)
    )
    _run_agent(
        lambda: spawn_ranks(
            _pod_worker,
            per_node,
            entry,
            ranks_dict,
            max_restarts=restarts,
            pod=pod,
            cuda=run.accelerator == "cuda",
        ),
        cfg,
        run,
        kind,
        run_dir,
        under_torchrun=True,
    )
    return run


def _stop_wait(cfg: DictConfig, run: RunLayout, kind: Optional[str]) -> tuple[float, str]:
    """How long the launcher waits for its ranks after a stop signal, and what it waits for."""
    if kind in STATELESS:
        return 30.0, "the ranks stop (nothing to save)"
    if kind == "benchmark":
        return grace_seconds(cfg, run), "the ranks finish the step in flight"
    return grace_seconds(cfg, run), "the ranks finish their step and write a checkpoint"


def _report_stop(result: Any, kind: Optional[str], under_torchrun: bool = False) -> None:
    """A job that stopped early says what it kept and how to continue, in one unwrapped line: raised
    for a signal (exit 128 + signal), printed for `trainer.stop_at_step` (exit 0). Under torchrun
    only global rank 0 speaks."""
    if not isinstance(result, dict) or "stopped at step" not in result:
        return
    speaks = os.environ.get("RANK", "0") == "0"
    if result.get("stopped by"):
        line = stopped_line(result["stopped by"], result["run dir"], kind, result, under_torchrun)
        raise JobStopped(result["stopped by"], line if speaks else "")
    if speaks:
        # rich comes with it: 15-30 ms of every launch, for this line
        from visiondist.observe.console import continue_command  # noqa: PLC0415 (rich, 15 ms)

        why = result.get("stopped because", "trainer.stop_at_step")
        print(
            f"stopped after step {result['stopped at step']} ({why}); continue "
            f"with: {continue_command(result['run dir'], under_torchrun)}",
            flush=True,
        )
