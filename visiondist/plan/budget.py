"""What a layout is planned against: the memory model's bytes for a resolved layout
(`layout_memory`), a device's and a node's memory budget and where each figure comes from, and the
planner's table for a config (`plan_for`). Used by the resolver (`parallel=auto`), the fit of a
named layout (`visiondist.plan.fit`) and the tools that plan."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from omegaconf import DictConfig

from visiondist.config import ConfigError
from visiondist.config.layout import RunLayout
from visiondist.config.resolution import planned_tokens
from visiondist.models.registry import spec_of
from visiondist.plan.memory import rank_memory
from visiondist.plan.planner import plan_config
from visiondist.plan.world import device_memory_gb, devices_named, host_memory_gb, named_board


def planned_shape(cfg: DictConfig):
    """The model shape the memory plan counts (its family's `planner_shape`; None for detectors):
    under data.resolution=native with the tokens per image of its most costly step, so that the plan
    budgets tokens."""
    shape_of = spec_of(cfg.model).planner_shape
    if shape_of is None:
        return None
    shape = shape_of(cfg.model)
    if cfg.data.get("resolution", "square") == "native":
        shape = replace(shape, seq_tokens=planned_tokens(cfg))
    return shape


def layout_memory(cfg: DictConfig, run: RunLayout, pp_rank: Optional[int] = None, dp_rank: int = 0):
    """The memory model's bytes for `cfg`'s ViT under `run`: on its busiest rank, or on the rank at
    pipeline stage `pp_rank` and DP rank `dp_rank` (`visiondist.plan.memory.rank_memory`)."""
    t = cfg.trainer
    return rank_memory(
        planned_shape(cfg),
        run.dp,
        run.tp,
        run.pp,
        int(cfg.data.batch_size),
        run.grad_accum or int(t.grad_accum),
        str(cfg.optim.name),
        float(t.ema_decay) > 0,
        str(t.precision),
        run.schedule,
        run.stages_per_rank,
        run.microbatches,
        pp_rank=pp_rank,
        fsdp=run.fsdp,
        offload=run.offload,
        checkpointing=run.activation_checkpointing,
        sequence_parallel=run.sequence_parallel,
        dp_rank=dp_rank,
        shard_size=run.shard_size,
        keep=run.checkpoint_keep,
    )


def plan_for(
    cfg: DictConfig, devices: int, nodes: int, memory_gb: float, accelerator: str = "cuda"
):
    """The memory planner's table for `cfg` on `devices` over `nodes` of `memory_gb` each, with the
    model shape its family declares (`ModelSpec.planner_shape`). Offloaded state must fit
    `parallel.host_memory_gb` per node (0: this machine's memory), together with the devices' bytes
    where the devices are the host (the CPU, not emulated).

    Args:
        cfg: the composed config of a ViT classifier.
        devices: the devices of the whole world.
        nodes: the nodes they are spread over.
        memory_gb: one device's memory, in GB (`memory_budget`).
        accelerator: "cuda" or "cpu".

    Returns:
        The planner's `Plan`: a row per layout (its bytes, its step time, whether it fits) and the
        choice.

    Raises:
        ConfigError: the model is a detector, which the planner does not model.
    """
    spec = spec_of(cfg.model)
    if spec.planner_shape is None:
        raise ConfigError(
            f"the memory planner plans ViT classifiers; {cfg.model.name} is a detector: name a "
            "layout (parallel=ddp)"
        )
    return plan_config(
        planned_shape(cfg),
        cfg,
        devices,
        nodes,
        memory_gb,
        host_budget(cfg)[0],
        _devices_are_host(cfg, accelerator),
    )


def _devices_are_host(cfg: DictConfig, accelerator: str) -> bool:
    """Whether the planner's devices are this host's memory (the CPU, unless
    parallel.device_memory_gb or parallel.gpu names the devices)."""
    return accelerator != "cuda" and not devices_named(cfg.parallel)


def host_budget(cfg: DictConfig) -> tuple[float, str]:
    """GB of host memory per node for offloaded state, and where the figure comes from."""
    if cfg.parallel.host_memory_gb:
        return float(cfg.parallel.host_memory_gb), "parallel.host_memory_gb"
    return host_memory_gb(), "this machine's; parallel.host_memory_gb sets it"


def memory_budget(
    cfg: DictConfig, accelerator: str, per_node: int, share_gpu: bool = False
) -> tuple[float, str]:
    """GB of one rank's device for the planner, and where the figure comes from (ranks sharing a GPU
    get their part of it)."""
    if cfg.parallel.device_memory_gb:
        return float(cfg.parallel.device_memory_gb), "parallel.device_memory_gb"
    board = named_board(cfg.parallel)
    if board is not None:
        return board.memory_gb, f"parallel.gpu={board.key}"
    if accelerator == "cuda":
        import torch  # noqa: PLC0415 (torch, 2 s: plan/ is torch-free)

        if not torch.cuda.is_available():
            raise ConfigError(
                "parallel=auto cannot read the GPU's memory here: set parallel.device_memory_gb"
            )
        shared = f" / {per_node} ranks sharing it (trainer.share_gpu)" if share_gpu else ""
        return (
            device_memory_gb(accelerator, per_node, share_gpu),
            f"the GPU's memory ({torch.cuda.get_device_name(0)}){shared}",
        )
    memory = device_memory_gb(accelerator, per_node)
    ranks = f"{per_node} rank{'s' if per_node > 1 else ''}"
    return memory, f"the host's {memory * per_node:.3g} GB / {ranks} per node (CPU)"
