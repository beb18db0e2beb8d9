"""Starting the ranks of a job (`launch`): self-launched through torch's elastic launcher, or joined
under torchrun / srun, or as a Kubernetes pod's node (`launch_pod`); each rank's set-up is
`launch/rank.py`'s (`run_rank`); a stopped job's one line here (a failed job's:
`visiondist.launch.failed`).

The launching process imports this module to plan and start a job: what only a rank needs (the
mesh and DTensor, the loader workers and OpenCV, torch's elastic rendezvous, the failure records and
their rich console) is imported where a rank needs it (`# noqa: PLC0415 (rank-side)`).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any, Callable, Optional, cast

from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.api import SignalException

from visiondist.config import to_container
from visiondist.config.layout import RunLayout
from visiondist.engine.run import ELSEWHERE
from visiondist.launch.estimate import check_gpu_layout
from visiondist.launch.failed import one_line_failure
from visiondist.launch.pods import PodJob, pod_job, pod_ranks
from visiondist.launch.rank import Entry, elastic_worker, inductor_cache_dir, pod_worker, run_rank
from visiondist.launch.rundir import (
    STATELESS,
    _write_plan,
    new_run_dir,
    run_dirs_released,
    run_kind,
)
from visiondist.launch.shared import shared_gpu_line
from visiondist.launch.slurm import slurm_env
from visiondist.launch.spawn import STOP_GRACE_ENV, _quiet_agent, spawn_local, spawn_ranks
from visiondist.launch.stop import JobStopped, LauncherStop, grace_seconds, stopped_line
from visiondist.observe.progress import drawn_from_feed, in_notebook
from visiondist.plan import announce, cuda_device_count, resolve
from visiondist.plan.compiling import compile_plan
from visiondist.plan.world import device_memory_gb, under_torchrun
from visiondist.utils.logs import handed_on, say

log = logging.getLogger(__name__)


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
    with handed_on(), run_dirs_released():  # the lines above, into the run's log file
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
                    elastic_worker,
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
    if run.fitted and main:  # the ranks log it (engine.announce): their RunLayout holds it
        print(run.fitted, flush=True)
    # several ranks, no GPU found under accelerator=auto: stop, estimated
    check_gpu_layout(cfg, run, kind)
    if run.fsdp and run.dp == 1 and main:
        say(
            "FSDP over 1 rank shards nothing (it runs as one process would): give the ranks, e.g. "
            "trainer.devices=2 or parallel.dp=2",
            warning=True,
        )
    # a test of correctness: said, and its memory summed
    if run.share_gpu and main:
        say(shared_gpu_line(cfg, run, device_memory_gb("cuda", 1)))
    # an evaluation on plain DDP: nothing chosen to say
    if run.chosen_by == "parallel=auto" and not (stateless and run.plain_ddp) and main:
        announce(cfg, run, auto_plan)
    # Inductor's caches (FX graphs, autograd, kernels) kept across runs, not in /tmp
    if run.compile:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
    if cfg.trainer.compile == "auto" and run.accelerator == "cuda" and main:
        say(
            f"trainer.compile=auto: {'compiling' if run.compile else 'not compiling'}: "
            f"{compile_plan(cfg, run)[3]}"
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
        say(f"data.decode_on=auto: {why}")
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
    say(pod.line() + f" ({per_node} per pod)")
    if run.fitted and pod.node_rank in (0, None):
        print(run.fitted, flush=True)
    run_dir = Path(cfg.trainer.run_dir).expanduser() if cfg.trainer.run_dir else None
    restarts = cfg.trainer.max_restarts if pod.max_restarts is None else pod.max_restarts
    ranks_dict = with_decode_choice(
        ranks_cfg, run, to_container(ranks_cfg), pod.node_rank in (0, None)
    )
    with handed_on():
        _run_agent(
            lambda: spawn_ranks(
                pod_worker,
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
