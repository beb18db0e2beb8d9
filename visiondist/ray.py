"""Ray Train: `visiondist.ray.train(overrides)` trains inside Ray Train's TorchTrainer workers.

    import visiondist.ray
    result = visiondist.ray.train(
        ["model=vit_base", "parallel=tp2", "data=imagenet", "data.root=/data/imagenet"],
        num_workers=16, use_gpu=True, storage_path="/mnt/shared/ray")

Ray starts one worker per GPU (`num_workers`) and creates the process group itself; each worker then
runs the same trainer as `tools/train.py` under torchrun does: it reads its rank and the world from
the variables Ray sets, joins the process group Ray made (no second init), resolves the layout the
config asks for (DDP, TP, PP, FSDP or parallel=auto, on the world Ray gave) and writes the run dir
under Ray's storage (`<storage_path>/<name>/`, a file system every worker sees), checkpoints
included. A failed worker group restarted by Ray (`RunConfig(failure_config=...)`) continues from
the run dir's newest checkpoint. Returns the training summary rank 0 reports (the same as
summary.json), with "run dir".

The overrides are checked here, before any worker starts; a bad one raises
`visiondist.config.ConfigError` with its one line. Needs `pip install visiondist[ray]`.

Ray is the optional extra [ray] (`# noqa: PLC0415 (optional extra: ray)`); what only a worker runs
(the launcher and the trainer, with torch: about 2 s) is imported in the worker, not by the driver
(`# noqa: PLC0415 (worker-side)`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any, Optional, cast

from omegaconf import DictConfig, OmegaConf

from visiondist.cli.load import load_config
from visiondist.config import ConfigError
from visiondist.plan import resolve_on
from visiondist.runs import completed_step, train_longer

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def train(
    overrides: list[str],
    num_workers: Optional[int] = None,
    use_gpu: Optional[bool] = None,
    storage_path: Optional[str] = None,
    name: Optional[str] = None,
    **run_config: Any,
) -> dict:
    """Train with `overrides` (tools/train.py's) on `num_workers` Ray Train workers (default: the
    ranks the config names, parallel.dp x tp x pp or trainer.devices, else 1). `use_gpu`: default
    whether the Ray cluster has GPUs. `storage_path` / `name` / `run_config`: Ray's RunConfig (where
    the run dir goes). Module doc.

    Args:
        overrides: tools/train.py's overrides (group=option, group.key=value), checked here.
        num_workers: Ray Train workers, one rank each; None: the ranks the config names.
        use_gpu: a GPU per worker; None: whether the Ray cluster has GPUs.
        storage_path: where Ray keeps the run (a path every worker mounts; default
            ~/ray_results); the run dir is `<storage_path>/<name>/run`.
        name: the Ray run's name; None: `visiondist-<date>_<time>`.
        **run_config: more of Ray's `RunConfig` (e.g. `failure_config`).

    Returns:
        The training summary rank 0 wrote (summary.json).

    Raises:
        ConfigError: a bad override, a layout the workers cannot run, or Ray not installed.
    """
    try:
        import ray  # noqa: PLC0415 (optional extra: ray)
        from ray.train import RunConfig, ScalingConfig  # noqa: PLC0415 (optional extra: ray)
        from ray.train.torch import TorchConfig, TorchTrainer  # noqa: PLC0415 (optional extra: ray)
    except ImportError:
        raise ConfigError("visiondist.ray needs Ray Train: pip install 'visiondist[ray]'") from None

    if (
        storage_path is not None
        and "://" in storage_path
        and not storage_path.startswith("file://")
    ):
        raise ConfigError(
            f"storage_path={storage_path}: the run dir and its checkpoints are files the workers "
            "write and read back: give a path on a file system every worker mounts (e.g. NFS), "
            "not a URI"
        )
    if any(o.startswith(("trainer.run_dir=", "hydra.run.dir=")) for o in overrides):
        raise ConfigError(
            "the run dir is Ray's: drop trainer.run_dir and give storage_path= / name= instead"
        )
    # one line for a bad override, before any worker
    cfg = load_config(CONFIGS, list(overrides), inputs="train")
    workers = num_workers or _ranks(cfg)
    # a layout the workers cannot run (dp x tp x pp != num_workers, ...): its line, here
    resolve_on(cfg, workers, 1)
    storage = Path((storage_path or "~/ray_results").removeprefix("file://")).expanduser().resolve()
    name = name or f"visiondist-{dt.datetime.now():%Y-%m-%d_%H-%M-%S}"
    run_dir = storage / name / "run"
    in_run = cast(DictConfig, OmegaConf.merge(cfg, {"trainer": {"run_dir": str(run_dir)}}))
    step = completed_step(in_run)
    # the same call again: nothing to do, nothing rewritten (as tools/train.py)
    if step is not None:
        print(
            f"{run_dir} is complete at step {step}: nothing to do (to train longer, "
            f"{train_longer(in_run, step)})",
            flush=True,
        )
        return json.loads((run_dir / "summary.json").read_text())
    if not ray.is_initialized():
        ray.init()
    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    trainer = TorchTrainer(
        _worker,
        train_loop_config={
            "overrides": [
                *overrides,
                f"trainer.run_dir={run_dir}",
                f"trainer.accelerator={'cuda' if use_gpu else 'cpu'}",
            ]
        },
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        run_config=RunConfig(name=name, storage_path=str(storage), **run_config),
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    summary = run_dir / "summary.json"  # written by global rank 0, as for any run
    if not summary.is_file():
        raise RuntimeError(
            f"Ray Train finished but {run_dir} holds no summary.json: see the workers' output above"
        )
    return json.loads(summary.read_text())


def _ranks(cfg) -> int:
    t, p = cfg.trainer, cfg.parallel
    if t.devices > 0:
        return int(t.devices)
    if p.dp > 0:
        return int(p.dp * p.tp * p.pp)
    return int(p.tp * p.pp)


def _worker(config: dict) -> None:
    """One Ray Train worker: a rank of the job, as under torchrun (`visiondist.launch.launch` sees
    RANK / WORLD_SIZE / LOCAL_RANK and the process group Ray initialised)."""
    import ray.train  # noqa: PLC0415 (optional extra: ray)
    import torch.distributed as dist  # noqa: PLC0415 (worker-side)

    from visiondist.engine.run import train as train_rank  # noqa: PLC0415 (worker-side)
    from visiondist.launch import launch  # noqa: PLC0415 (worker-side)

    # Ray sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; the node's index:
    context = ray.train.get_context()
    os.environ.setdefault("GROUP_RANK", str(context.get_node_rank()))
    assert dist.is_initialized(), "Ray Train's TorchTrainer initialises the process group"
    cfg = load_config(CONFIGS, config["overrides"], inputs="train")
    box: dict[str, Any] = {}
    launch(_keep(train_rank, box), cfg)
    summary = box.get("result")
    # Ray's view
    ray.train.report(summary if isinstance(summary, dict) and context.get_world_rank() == 0 else {})


def _keep(entry, box: dict):
    """`entry`, keeping its return value in `box` (launch returns the layout, not the result)."""

    def kept(*args, **kwargs):
        box["result"] = entry(*args, **kwargs)
        return box["result"]

    kept.__name__ = getattr(entry, "__name__", "train")
    if hasattr(entry, "run_kind"):  # what the run dir holds (`visiondist.launch.run_kind`)
        # a function's attribute, as `launch.run_kind` reads it
        kept.run_kind = entry.run_kind  # type: ignore[attr-defined]
    return kept
