"""Config + environment -> the one `RunLayout` of a job (the launching process; under torchrun /
srun every rank, each to the same result). `parallel=auto` asks the planner here and nowhere else;
the ranks never re-resolve."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Optional, cast

from omegaconf import DictConfig, OmegaConf

from visiondist.config import ConfigError, validate, variant_config
from visiondist.config.layout import RunLayout, microbatches_for, stages_per_rank_for
from visiondist.models.registry import EVAL_METRICS, TASKS, check_support, eval_metrics, spec_of
from visiondist.plan.budget import host_budget, layout_memory, memory_budget, plan_for
from visiondist.plan.compiling import compile_switches
from visiondist.plan.fit import fit
from visiondist.plan.world import World, cuda_device_count, find_accelerator, find_world

# also here, where the resolver uses them
__all__ = ["host_budget", "layout_memory", "memory_budget", "plan_for"]


def resolve(
    cfg: DictConfig,
    env: Optional[dict] = None,
    cuda_devices: Optional[int] = None,
    fit_named: bool = True,
    training: bool = True,
) -> tuple[RunLayout, Any]:
    """The layout this job runs under, and the planner's table when `parallel=auto` chose it (else
    None). Raises ConfigError naming the fix. `fit_named=False`: a named layout as named, unchecked
    against the device (a tool that reports the fit itself). `training=False` (an evaluation, a
    prediction): the training batch is not split over the ranks, so it is not checked against
    them.

    Args:
        cfg: the composed config, checked (`check`).
        env: the environment the ranks see (torchrun's / srun's variables); None: this process's.
        cuda_devices: the GPUs this process sees; None: counted here.
        fit_named: fit a named layout to the device (`visiondist.plan.fit`); False: as named.
        training: the run trains (its batch must split over the ranks).

    Returns:
        (the `RunLayout`, the planner's `Plan` where `parallel=auto` planned, else None).

    Raises:
        ConfigError: the layout cannot run here; the message names the fix.
    """
    env = dict(os.environ) if env is None else env
    world = find_world(cfg, env, cuda_device_count() if cuda_devices is None else cuda_devices)
    # OmegaConf types these DictConfig | ListConfig (or a container of either): a mapping's are
    # DictConfigs and dicts
    parallel = cast(dict[str, Any], OmegaConf.to_container(cfg.parallel))
    plan, reason, plain = None, "", False
    accum = int(cfg.trainer.grad_accum)
    auto = cfg.parallel.auto and not named_layout(cfg.parallel)
    if auto:
        # what was asked (dp, batch) must hold
        _layout(cfg, cast(DictConfig, OmegaConf.merge(cfg.parallel, {"auto": False})), world)
        before = _continued_layout(cfg, world)
        # continuing a run: the layout its first attempt chose, not a fresh plan
        if before is not None:
            parallel.update(before.parallel_overrides())
            accum = before.grad_accum or accum
            reason = f"the layout this run started with ({before.describe()}, layout.json)"
            plain = before.plain_ddp
        elif spec_of(cfg.model).planner_shape is None:  # detectors: data parallel, as asked of them
            reason = (
                f"{cfg.model.name} is a detector, which runs data parallel (the planner "
                "lays out ViT classifiers)"
            )
            plain = True
        else:
            plan = _plan_auto(cfg, world)
            parallel.update(plan.choice.candidate.overrides())
            accum, reason = plan.choice.candidate.accum, plan.reason
            plain = plan.plain_ddp
        # the chosen layout against the model
        check(cast(DictConfig, OmegaConf.merge(cfg, {"parallel": {**parallel, "auto": False}})))
    parallel["auto"] = False
    run = _layout(cfg, OmegaConf.create(parallel), world, accum, training)
    _check_on(cfg, run.accelerator)
    if auto:
        return run.replace(chosen_by="parallel=auto", reason=reason, plain_ddp=plain), plan
    # a named layout: checked against the device before any rank starts
    fitted = fit(cfg, run) if fit_named else run
    return (run if fitted is run else fitted.replace(**compile_switches(cfg, fitted))), plan


def _check_on(cfg: DictConfig, accelerator: str) -> None:
    """What the config asks of the device the run got: the memory-efficient and cuDNN attention
    kernels exist on CUDA only (on the CPU torch would fail at step 1 with no fix named)."""
    if accelerator != "cuda" and cfg.model.get("sdpa") in ("efficient", "cudnn"):
        raise ConfigError(
            f"model.sdpa={cfg.model.sdpa} is a CUDA attention kernel and this run is on the "
            f"{accelerator}: use model.sdpa=auto, flash (the CPU's fused kernel) or math"
        )


LAYOUT_SWITCHES = ("tp", "pp", "fsdp", "offload", "activation_checkpointing", "sequence_parallel")


def named_layout(p: DictConfig) -> bool:
    """Whether the user named a layout (tensor or pipeline parallel, FSDP, offload, checkpointing,
    SP) on top of `parallel=auto`: that layout runs as named (fitted to the device:
    `visiondist.plan.fit`); auto only chooses when the layout is left to it."""
    return p.tp > 1 or p.pp > 1 or any(bool(p[k]) for k in LAYOUT_SWITCHES[2:])


def resolve_on(
    cfg: DictConfig,
    devices: int,
    nodes: int,
    overrides: Optional[dict] = None,
    fit_named: bool = True,
) -> RunLayout:
    """The layout `cfg` (with `parallel.*` `overrides`, e.g. a planner candidate's) runs under on
    `devices` devices over `nodes` nodes, as if torchrun had started them, without having them: for
    the dry run, which builds such a world's ranks on this machine's CPU. A config left to
    `parallel=auto` with no `overrides` resolves to DDP, as a stand-in for what the job's ranks will
    plan on their devices (not fitted: nobody named it).

    Args:
        cfg: the composed config.
        devices: the devices of the whole world.
        nodes: the nodes they are spread over (devices // nodes each).
        overrides: `parallel.*` values laid over the config's (a planner candidate's); None: none.
        fit_named: fit a named layout to the device, as `resolve` does.

    Returns:
        The `RunLayout` of that world.
    """
    stand_in = overrides is None and cfg.parallel.auto and not named_layout(cfg.parallel)
    parallel = (
        {**(overrides or {}), "auto": False} if overrides is not None or cfg.parallel.auto else {}
    )
    per_node = devices // nodes
    merged = OmegaConf.merge(
        cfg,
        {
            "parallel": parallel,
            "trainer": {
                "accelerator": "cpu",
                "devices": per_node,
                "max_restarts": 0,
                "share_gpu": False,
            },
        },
    )
    cfg = cast(DictConfig, merged)  # onto a DictConfig (OmegaConf: DictConfig | ListConfig)
    check(cfg, mandatory=False)
    env = {"WORLD_SIZE": str(devices), "LOCAL_WORLD_SIZE": str(per_node), "LOCAL_RANK": "0"}
    return resolve(cfg, env=env, cuda_devices=0, fit_named=fit_named and not stand_in)[0]


def _continued_layout(cfg: DictConfig, world: World) -> Optional[RunLayout]:
    """The layout.json of the run `trainer.run_dir` continues, when it ran on a world like this
    one."""
    if not cfg.trainer.run_dir or cfg.trainer.resume != "auto":
        return None
    before = RunLayout.load(Path(cfg.trainer.run_dir).expanduser())
    if before is None or (before.world_size, before.accelerator) != (
        world.world_size,
        world.accelerator,
    ):
        return None
    return before


def check(cfg: DictConfig, mandatory: bool = True) -> None:
    """The whole check of a composed config before anything runs: each group on its own
    (`validate`), then the model family against the rest (`check_support`); the same for each
    benchmark variant (which may switch on what the family lacks).

    Args:
        cfg: the composed config.
        mandatory: every `???` value must be given; False: they may stay unset (planning, printing).

    Raises:
        ConfigError: the first rule the config breaks, naming the fix.
    """
    validate(cfg, mandatory)
    check_support(cfg)
    _check_best_metric(cfg)
    for variant in cfg.bench.variants:
        check_support(variant_config(cfg, variant))  # validated as it is built


def _plan_auto(cfg: DictConfig, world: World):
    memory, source = memory_budget(cfg, world.accelerator, world.per_node, world.share_gpu)
    plan = plan_for(
        cfg, world.world_size, max(1, world.world_size // world.per_node), memory, world.accelerator
    )
    plan.reason += f"; device memory: {source}"
    if plan.choice is None:
        raise ConfigError(f"parallel=auto: {plan.reason}")
    return plan


def _layout(
    cfg: DictConfig,
    p: DictConfig,
    world: World,
    grad_accum: Optional[int] = None,
    training: bool = True,
) -> RunLayout:
    """The mesh degrees of `p` on `world`, checked against it and the global batch (split into
    `grad_accum` accumulated micro-batches, default trainer.grad_accum), with every switch
    concrete."""
    ga = int(cfg.trainer.grad_accum) if grad_accum is None else grad_accum
    world_size, per_node, model_parallel = world.world_size, world.per_node, p.tp * p.pp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tp x parallel.pp = "
            f"{model_parallel}: run a multiple of {model_parallel} ranks (trainer.devices; under "
            "torchrun, --nproc-per-node x --nnodes)"
        )
    dp = world_size // model_parallel if p.dp == -1 else p.dp
    if dp * model_parallel != world_size:
        raise ConfigError(
            f"parallel.dp={p.dp} x tp={p.tp} x pp={p.pp} = {dp * model_parallel} ranks, but the "
            f"world size is {world_size}: set parallel.dp={world_size // model_parallel} or leave "
            "it at -1 to infer it"
        )
    if p.tp > 1 and per_node % p.tp:
        raise ConfigError(
            f"parallel.tp={p.tp} does not divide the {per_node} ranks per node: a tensor-parallel "
            f"group must sit inside one node; run a multiple of {p.tp} ranks per node "
            "(trainer.devices, or torchrun's --nproc-per-node)"
        )
    if training:
        _check_batch(cfg, p, dp, ga)
    base = RunLayout(
        world.accelerator,
        world_size,
        per_node,
        dp,
        p.tp,
        p.pp,
        grad_accum=ga,
        under_torchrun=world.under_torchrun,
        share_gpu=world.share_gpu,
    )
    return with_switches(base, cfg, p)


def with_switches(run: RunLayout, cfg: DictConfig, p: Optional[DictConfig] = None) -> RunLayout:
    """`run`'s mesh with the switches of `p` (default `cfg.parallel`) made concrete: the pipeline's
    stages per rank and micro-batches, the blocks that recompute, whether the timeline is recorded
    (by default on the CPU only). A benchmark variant uses it to change how a step computes on the
    same ranks.

    Args:
        run: the resolved layout whose mesh (world, dp, tp, pp) is kept.
        cfg: the composed config (the model's depth, the compile settings).
        p: the `parallel` group to read the switches from; None: `cfg.parallel`.

    Returns:
        `run` with its switches concrete.
    """
    p = cfg.parallel if p is None else p
    pipelined = run.pp > 1
    depth = int(cfg.model.depth) if spec_of(cfg.model).has_blocks else 0
    blocks = (
        (depth if p.checkpoint_blocks < 0 else int(p.checkpoint_blocks))
        if p.activation_checkpointing
        else 0
    )
    timeline = p.timeline if p.timeline is not None else run.accelerator != "cuda"
    switched = run.replace(
        sequence_parallel=bool(p.sequence_parallel),
        schedule=str(p.schedule),
        stages_per_rank=stages_per_rank_for(p.schedule, p.stages_per_rank) if pipelined else 1,
        microbatches=microbatches_for(run.pp, p.microbatches) if pipelined else 1,
        fsdp=bool(p.fsdp),
        shard_size=shard_size_for(run, p),
        offload=bool(p.offload),
        activation_checkpointing=bool(p.activation_checkpointing),
        checkpoint_blocks=blocks,
        checkpoint_keep=str(p.checkpoint_keep) if p.activation_checkpointing else "input",
        timeline=bool(timeline),
    )
    return switched.replace(**compile_switches(cfg, switched, p))


def shard_size_for(run: RunLayout, p: DictConfig) -> int:
    """FSDP's shard group size made concrete: every DP rank (0), one node's (-1), or as given,
    dividing dp."""
    if not p.fsdp:
        return 0
    size = {0: run.dp, -1: run.per_node}.get(int(p.shard_size), int(p.shard_size))
    if size > run.dp or run.dp % size:
        raise ConfigError(
            f"parallel.shard_size={p.shard_size} gives shard groups of {size} ranks, which do not "
            f"divide dp={run.dp}: use a divisor of {run.dp} (or 0: plain FSDP over all of them)"
        )
    return size


def _check_batch(cfg: DictConfig, p: DictConfig, dp: int, ga: int) -> None:
    d = cfg.data
    if p.pp > 1:
        m = microbatches_for(p.pp, p.microbatches)
        step = dp * ga * m
        if d.batch_size % step:
            raise ConfigError(
                f"data.batch_size={d.batch_size} (global) is not divisible by dp x "
                f"trainer.grad_accum x parallel.microbatches = {dp} x {ga} x {m}: each pipeline "
                f"step splits a DP rank's batch into {m} equal micro-batches; use e.g. "
                f"data.batch_size={max(1, math.ceil(d.batch_size / step)) * step}"
            )
    elif d.batch_size % (dp * ga):
        step = dp * ga
        raise ConfigError(
            f"data.batch_size={d.batch_size} (global) is not divisible by dp x trainer.grad_accum "
            f"= {dp} x {ga}: use a multiple of {step}, e.g. "
            f"data.batch_size={max(1, math.ceil(d.batch_size / step)) * step}"
        )
    elif (d.mixup > 0 or d.cutmix > 0) and (d.batch_size // (dp * ga)) % 2:
        raise ConfigError(
            "data.mixup / data.cutmix mix each micro-batch with its reverse and need an even "
            f"one, but data.batch_size={d.batch_size} gives {d.batch_size // (dp * ga)} per rank "
            f"and step: use an even multiple of dp x trainer.grad_accum = {dp * ga}"
        )


def auto_words(run: RunLayout) -> str:
    """parallel=auto's choice as the console and the run's log say it: "plain DDP on 2 ranks
    (cpu)", else the layout ("dp=1 tp=2 pp=1 (2 ranks on cpu)")."""
    if not run.plain_ddp:
        return run.describe()
    ranks = f"{run.world_size} rank{'s' if run.world_size > 1 else ''}"
    return f"plain DDP on {ranks} ({run.accelerator})"


def announce(cfg: DictConfig, run: RunLayout, plan: Any) -> None:
    """Print `parallel=auto`'s choice (once per job: the launching process, or global rank 0): one
    line when it is plain DDP; the planner's table too when the training state did not fit and it
    chose another layout.

    Args:
        cfg: the composed config (the model's name).
        run: the layout `resolve` returned.
        plan: the planner's `Plan` `resolve` returned, or None (plain DDP, or a detector).
    """
    # rich (30-50 ms of `tools/train.py --cfg job`, which prints nothing with it) where it prints
    from rich.console import Console  # noqa: PLC0415 (rich: 30-50 ms, printed for auto only)

    console = Console(width=120)
    if run.plain_ddp or plan is None:  # plain DDP (a detector's), or a continued run's layout
        console.print(
            f"parallel=auto chose {auto_words(run)}: {run.reason}",
            soft_wrap=True,
            highlight=False,
        )
        return
    console.print(
        plan.table(
            f"parallel=auto: {cfg.model.name} on {run.world_size} devices of "
            f"{plan.hardware.memory_gb:.3g} GB"
        )
    )
    console.print(
        f"parallel=auto chose [bold]{plan.choice.candidate.name}[/bold]: {plan.reason}",
        soft_wrap=True,
    )


def rank_layout(cfg: DictConfig, device=None, local_rank: int = 0):
    """In a process group that is already up (a test's ranks, a notebook): resolve `cfg` for its
    world and build this rank's `Layout` with the `RunLayout` attached.

    Args:
        cfg: the composed config; its `parallel` group names the layout.
        device: this rank's device; None: the CPU.
        local_rank: this rank's index on its node.

    Returns:
        This rank's `visiondist.parallel.Layout`.
    """
    # a rank's side: torch and DTensor (`visiondist.parallel`), which the launcher plans without
    import torch  # noqa: PLC0415 (torch: plan/ is torch-free)
    import torch.distributed as dist  # noqa: PLC0415 (torch: plan/ is torch-free)

    from visiondist.parallel import build_layout  # noqa: PLC0415 (DTensor: rank side only)

    size = dist.get_world_size()
    run = _layout(
        cfg, cfg.parallel, World(find_accelerator(cfg, cuda_device_count()), size, size, False)
    )
    device = device if device is not None else torch.device("cpu")
    return build_layout(run.dp, run.tp, run.pp, device, local_rank, run=run)


def _check_best_metric(cfg: DictConfig) -> None:
    """trainer.best_metric names an evaluation metric of the model's task (a metrics.csv column)."""
    metric, task = cfg.trainer.best_metric, TASKS.get(cfg.model.family)
    names = eval_metrics(cfg.model) if task is not None else ()
    if metric is not None and metric in EVAL_METRICS["segmentation"] and metric not in names:
        raise ConfigError(
            f"trainer.best_metric={metric} is a mask metric, and {cfg.model.name} predicts no "
            "masks: train a model with a mask head (model=maskrcnn_mobilenet_v3, maskrcnn_r50, "
            "or a vitdet_* model with model.masks=true), or keep the best by box AP "
            "(trainer.best_metric=val_mAP)"
        )
    if metric is not None and task is not None and metric not in names:
        raise ConfigError(
            f"trainer.best_metric={metric} is not an evaluation metric of {task}: use one of "
            f"{', '.join(names)}"
        )
    if metric is not None and metric.startswith("val_ema_") and not cfg.trainer.ema_decay:
        raise ConfigError(
            f"trainer.best_metric={metric} is the EMA's, and this run keeps none: set "
            f"trainer.ema_decay (e.g. 0.9998) or use {metric.replace('val_ema_', 'val_')}"
        )
