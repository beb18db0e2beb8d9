"""Ranks sharing one GPU (`trainer.share_gpu=true`): the line a job starts with, and the memory they
need together.

The mode runs a node's ranks on its GPU 0 over gloo (the placement and the backend:
`visiondist.plan.world`), to check a layout's parallel code on CUDA memory and streams where fewer
GPUs than ranks are at hand. Before any rank starts, the launching process says so in one line: what
the mode checks and what it does not (NCCL, speed), and, for the ViTs the memory model plans, the
bytes every rank of the node needs added up (each rank's figure is what it would need on a GPU of
its own: sharing one, they need the sum). A sum over the GPU's memory is refused, naming the fix.
"""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from visiondist.config import ConfigError
from visiondist.config.layout import RunLayout
from visiondist.models.registry import spec_of
from visiondist.plan.resolve import layout_memory


def node_bytes(cfg: DictConfig, run: RunLayout) -> Optional[tuple[int, int]]:
    """(bytes of every rank of the first node together, bytes of its busiest rank) by the memory
    model, or None for a model it does not plan (detectors). Global rank r sits at mesh coordinate
    (pp, dp, tp) in row-major order."""
    if spec_of(cfg.model).planner_shape is None:
        return None
    per_rank = []
    for rank in range(run.per_node):
        pp_rank, dp_rank = divmod(rank // run.tp, run.dp)
        per_rank.append(layout_memory(cfg, run, pp_rank, dp_rank).device)
    return sum(per_rank), max(per_rank)


def shared_gpu_line(cfg: DictConfig, run: RunLayout, gpu_gb: float) -> str:
    """The start-up line of a job whose ranks share a GPU of `gpu_gb`; ConfigError when the memory
    model's sum over the node's ranks exceeds it."""
    ranks = f"{run.per_node} rank{'s' if run.per_node > 1 else ''}"
    line = (
        f"trainer.share_gpu=true: {ranks} share cuda:0 over gloo, a test of correctness only "
        "(NCCL is not what runs, and the step is never faster than on one GPU)"
    )
    planned = node_bytes(cfg, run)
    if planned is None:
        return (
            line
            + f"; no memory figure ({cfg.model.name} is a detector: the memory model plans ViT "
            "classifiers)"
        )
    total, busiest = planned[0] / 1e9, planned[1] / 1e9
    if total > gpu_gb:
        raise ConfigError(
            f"trainer.share_gpu=true: {ranks} on one GPU need {total:.3g} GB together by the "
            f"memory model ({busiest:.3g} GB on the busiest) and the GPU has {gpu_gb:.3g} GB: run "
            "fewer ranks (trainer.devices, parallel.dp) or a smaller data.batch_size"
        )
    return line + (
        f"; the memory model plans {total:.3g} GB for them together ({busiest:.3g} GB on the "
        f"busiest rank) of the GPU's {gpu_gb:.3g} GB, each process's CUDA context on top"
    )
