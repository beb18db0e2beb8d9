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
    plan, reason = None, ""
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
        elif spec_of(cfg.model).planner_shape is None:  # detectors: data parallel, as asked of them
            reason = (
                f"{cfg.model.name} is a detector, which runs data parallel (the planner "
                "lays out ViT classifiers)"
            )
        else:
            plan = _plan_auto(cfg, world)
            parallel.update(plan.choice.candidate.overrides())
            accum, reason = plan.choice.candidate.accum, plan.reason
        # the chosen layout against the model
        check(cast(DictConfig, OmegaConf.merge(cfg, {"parallel": {**parallel, "auto": False}})))
    parallel["auto"] = False
    run = _layout(cfg, OmegaConf.create(parallel), world, accum, training)
    _check_on(cfg, run.accelerator)
    if auto:
        return run.replace(chosen_by="parallel=auto", reason=reason), plan
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


def compile_switches(cfg: DictConfig, run: RunLayout, p: Optional[DictConfig] = None) -> dict:
    """The RunLayout fields `compile`, `compile_scope` and `cuda_graphs` for `run`'s mesh (see
    `compile_plan`)."""
    compile_, scope, graphs, _ = compile_plan(cfg, run, p)
    return {"compile": compile_, "compile_scope": scope, "cuda_graphs": graphs}


# ViT widths up to this are launch-bound on a GPU when compiled whole: trainer.cuda_graphs=auto
# replays them
CUDA_GRAPHS_MAX_WIDTH = 384
# compile=auto compiles the whole model up to this width (ViT-Ti/S/B); wider ViTs (L, H, g: 24-40
# blocks) per block, where the step is GPU-bound either way (ViT-B/16 on an H100: 3,260 img/s whole,
# 3,257 per block) and one graph of every block takes minutes to compile (ViT-H/14's, over 150 s on
# an H100) where one block's takes seconds
WHOLE_MODEL_MAX_WIDTH = 768


def compile_plan(
    cfg: DictConfig, run: RunLayout, p: Optional[DictConfig] = None
) -> tuple[bool, str, bool, str]:
    """(compiled, scope, CUDA graphs, why) for `trainer.compile` and `trainer.cuda_graphs` on
    `run`'s mesh.

    Scope: `model` compiles the whole model in one graph where the layout leaves it whole on each
    rank (one device or DDP, whose buckets torch's DDPOptimizer cuts the graph at) and the ViT is at
    most 768 wide (auto; wider ones per block: GPU-bound either way, and far quicker to compile);
    `blocks` compiles each transformer block where tensor parallelism (the block's collectives), a
    pipeline (stages of blocks) or FSDP2 (a block's gathered weights) works block by block, and for
    detectors (their ViT backbone's blocks). `trainer.compile=model|blocks` names it.

    CUDA graphs (auto): on for the whole-model graph of a narrow ViT (width <= 384: ViT-Ti/S) on one
    GPU, one micro-batch per step, where the step is launch-bound; off otherwise (ViT-B and up keep
    the GPU busy)."""
    compiled, why = compile_choice(cfg, run.accelerator, p)
    p = cfg.parallel if p is None else p
    t = cfg.trainer
    asked = t.compile
    if not compiled:
        if t.get("cuda_graphs", "auto") is True:
            raise ConfigError(
                "trainer.cuda_graphs=true replays the compiled model, and nothing is compiled "
                f"here ({why}): CUDA graphs need a GPU and trainer.compile=true or auto there"
            )
        return False, "none", False, why
    if cfg.model.family == "detr":
        if asked == "blocks":
            raise ConfigError(
                f"trainer.compile=blocks: {cfg.model.name} has no transformer blocks; "
                "trainer.compile=model compiles its network (backbone, encoder, decoder) whole"
            )
        if t.get("cuda_graphs", "auto") is True:
            raise ConfigError(
                f"trainer.cuda_graphs=true: {cfg.model.name}'s denoising queries and matching "
                "read the device each step, which a CUDA graph cannot replay; use "
                "trainer.cuda_graphs=auto or false"
            )
        return (
            True,
            "model",
            False,
            (
                "its network (backbone, encoder, decoder) compiled whole, the loss and its "
                "matching eager"
            ),
        )
    if cfg.data.get("resolution", "square") == "native":
        return _native_compile(asked, t.get("cuda_graphs", "auto"))
    apart = (
        "tensor parallelism: each block compiled with its collectives"
        if run.tp > 1
        else "pipeline parallelism: each stage's blocks compiled"
        if run.pp > 1
        else "FSDP2: each block compiled inside its own gather and reduce-scatter"
        if run.fsdp
        else f"{cfg.model.name}: its ViT backbone's blocks compiled"
        if cfg.model.family != "vit"
        else ""
    )
    wide = int(cfg.model.get("embed_dim") or 0) > WHOLE_MODEL_MAX_WIDTH
    if asked == "blocks" or (apart and asked != "model"):
        scope = "blocks"
        why = apart or "trainer.compile=blocks"
    elif wide and asked in ("auto", True):
        scope = "blocks"
        why = (
            f"each block compiled: a ViT {cfg.model.embed_dim} wide keeps the GPU busy block by "
            "block (ViT-B/16 on an H100: 3,260 img/s whole, 3,257 per block) and compiles one "
            "block in seconds where its whole graph takes minutes (trainer.compile=model "
            "compiles it whole)"
        )
    else:
        if apart:
            raise ConfigError(
                f"trainer.compile=model compiles the whole model, but {apart.split(':')[0]} works "
                "block by block: use trainer.compile=blocks (or auto, which chooses it)"
            )
        scope = "model"
        why = (
            "the whole model compiled in one graph (ViT-S/16 bf16 at batch 256 on an H100: 7,508 "
            "img/s against 5,919 compiled per block, which left the GPU idle 46% of the step)"
            if asked in ("auto", True)
            else "trainer.compile=model"
        )
    graphs, graphs_why = _cuda_graphs(cfg, run, scope)
    return True, scope, graphs, why + ("; " + graphs_why if graphs_why else "")


def _native_compile(asked, cuda_graphs) -> tuple[bool, str, bool, str]:
    """`compile_plan` under data.resolution=native: each block compiled; the whole model and CUDA
    graphs refused."""
    if asked == "model" or cuda_graphs is True:
        raise ConfigError(
            f"trainer.{'compile=model' if asked == 'model' else 'cuda_graphs=true'} with "
            "data.resolution=native: the batch's image grids and sequence lengths change from "
            "step to step, a graph for each; use trainer.compile=blocks (or auto, which chooses "
            "it) and trainer.cuda_graphs=auto"
        )
    return (
        True,
        "blocks",
        False,
        (
            "data.resolution=native: each block compiled (its sequence lengths come from a few "
            "buckets); the embedding, resampled to each batch's image grids, eager"
        ),
    )


def _cuda_graphs(cfg: DictConfig, run: RunLayout, scope: str) -> tuple[bool, str]:
    t, m = cfg.trainer, cfg.model
    accum = run.grad_accum or int(t.grad_accum)
    asked = t.get("cuda_graphs", "auto")
    if asked is False:
        return False, ""
    blocker = (
        "it compiles the whole model only (trainer.compile=blocks here)"
        if scope != "model"
        else "it needs CUDA"
        if run.accelerator != "cuda"
        else f"it runs on one GPU only ({run.world_size} ranks here)"
        if run.world_size > 1
        else f"it runs one micro-batch per step (trainer.grad_accum={accum})"
        if accum > 1
        else ""
    )
    if asked is True:
        if blocker:
            raise ConfigError(
                f"trainer.cuda_graphs=true: {blocker}; use trainer.cuda_graphs=auto or false"
            )
        return True, "replayed as CUDA graphs (trainer.cuda_graphs=true)"
    if blocker or str(t.get("fp8", "off")) != "off" or run.activation_checkpointing:
        return False, ""
    if int(m.get("embed_dim") or 0) > CUDA_GRAPHS_MAX_WIDTH:
        return False, ""
    return True, (
        f"replayed as CUDA graphs: a ViT {m.embed_dim} wide launches kernels faster than Python "
        "can (ViT-S/16 on an H100: GPU idle 28% of the compiled step, 3% as CUDA graphs, 1.044x)"
    )


def compile_choice(
    cfg: DictConfig, accelerator: str, p: Optional[DictConfig] = None
) -> tuple[bool, str]:
    """(whether the blocks are compiled, why) for `trainer.compile`: true and false as asked; auto
    compiles a model with transformer blocks on CUDA, where per-block compilation made ViT-B/16's
    step 1.28x faster on an H200 (not on the CPU: 1.045x for Inductor's C++ on 2 cores, with a
    minute of compiling), unless the zero-bubble schedule splits the blocks' backward or Triton is
    missing."""
    asked, p = cfg.trainer.compile, cfg.parallel if p is None else p
    if asked in (True, False, "model", "blocks"):
        return asked is not False, "trainer.compile=" + str(asked).lower()
    if cfg.model.family == "detr":
        return False, (
            f"{cfg.model.name} runs eager unless trainer.compile=model asks (its network compiled "
            "whole; not measured on a GPU yet, and the library's RT-DETR and D-FINE break the "
            "graph at their denoising queries)"
        )
    if not spec_of(cfg.model).has_blocks:
        return False, f"{cfg.model.name} has no transformer blocks to compile"
    if accelerator != "cuda":
        return (
            False,
            "on the CPU, compiling costs minutes and gained 1.045x (benchmarks/RESULTS.md)",
        )
    if p.pp > 1 and p.schedule == "zero_bubble":
        return (
            False,
            "the zero-bubble schedule splits each block's backward, which a compiled block cannot",
        )
    try:
        from torch.utils._triton import has_triton  # noqa: PLC0415 (torch: plan/ is torch-free)

        triton = has_triton()
    except Exception:
        triton = False
    if not triton:
        return False, "Triton, which Inductor compiles CUDA kernels with, is not importable here"
    return True, "compiled on CUDA"


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
    if plan is None or plan.plain_ddp:  # plain DDP (or a detector's)
        ranks = f"{run.world_size} rank{'s' if run.world_size > 1 else ''}"
        console.print(
            f"parallel=auto chose plain DDP on {ranks} ({run.accelerator}): {run.reason}",
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
