"""The dry run: a layout checked at full scale on one machine, before anyone pays for the cluster.

Chosen ranks of the full world are built one after another in this process, each by the training
code itself (`build_layout`, the TP plan, the pipeline's stage cut and schedule, FSDP2) over torch's
fake process group at the job's world size, which accepts every collective and moves nothing; the
model lives on the meta device (under FSDP on fake tensors, which FSDP2 requires), so no rank's
memory is ever allocated. Each rank then runs one training step (forward, backward, the gradient
reductions, clipping, the optimizer) and its figures are read off the built objects:

- parameters, gradients and optimizer state: the bytes of this rank's tensors (shards, stages) after
  the step;
- activations: what autograd saves for the backward of one micro-batch through this rank's stages
  (saved-tensor hooks; parameters and views of them left out); autocast is emulated on meta tensors
  by running the same ops in the autocast dtype (matmuls, convolutions and attention; norms and
  softmax in fp32);
- collectives: the payload of every collective the step issues (all-reduce, all-gather,
  reduce-scatter, send, receive), per mesh dimension, counted where the call is dispatched;
- start-up peak: with the meta-device build a rank allocates only its own shards, then draws each
  parameter's full value on the host one at a time to cut its part: its parameters on the device
  plus the largest full tensor.

Beside each figure: the planner's (`visiondist.plan.memory`) and the ratio; a figure more than
`TOLERANCE` off is flagged. A layout the code cannot build or step fails here, naming the rank, not
on the cluster. Under DDP the gradients are reduced by the same bucketed all-reduce the pipeline
uses (DDP's reducer needs real tensors).
"""

from __future__ import annotations

import time
from typing import Optional

from omegaconf import DictConfig

from visiondist.config.layout import RunLayout
from visiondist.models.shape import ViTShape
from visiondist.plan.fit import as_run
from visiondist.verify.measure import (
    measure_detector_rank,
    measure_rank,
    planned_detector,
    planned_rank,
)
from visiondist.verify.report import TOLERANCE, Figure, RankReport, report_table

__all__ = ["TOLERANCE", "DryRunError", "RankReport", "chosen_ranks", "dry_run", "report_table"]


def chosen_ranks(run: RunLayout) -> list[int]:
    """The ranks a dry run measures by default.

    The first rank of the first stage, one rank in the middle of every dim, the last rank of the
    last stage.

    Args:
        run: the resolved layout (its pp, dp and tp sizes).

    Returns:
        Their global ranks, sorted, each once.
    """

    def rank(pp: int, dp: int, tp: int) -> int:
        return (pp * run.dp + dp) * run.tp + tp

    middle = rank(run.pp // 2, run.dp // 2, run.tp // 2)
    return sorted({0, middle, run.world_size - 1})


def dry_run(
    cfg: DictConfig,
    shape: Optional[ViTShape],
    run: RunLayout,
    ranks: Optional[list[int]] = None,
    progress=None,
) -> list[RankReport]:
    """Measure `ranks` (default `chosen_ranks`) of `run` and set each beside the plan; `shape`: the
    model family's planner shape (None: a detector, planned from its tensors). The step accumulates
    what `run` does (a named layout fitted by accumulation: more than `cfg`'s
    trainer.grad_accum).

    Args:
        cfg: the job's resolved config.
        shape: the model's planner shape (`ModelSpec.planner_shape`); None for a detector.
        run: the resolved layout of the full-size job.
        ranks: the global ranks to build and step, one after another; None: `chosen_ranks(run)`.
        progress: called with each rank's `RankReport` as soon as it is measured (None: not).

    Returns:
        A `RankReport` per rank measured, in order.

    Raises:
        DryRunError: a rank failed to build or step (named, with the layout and the error).
    """
    cfg = as_run(cfg, run)
    reports = []
    for rank in ranks if ranks is not None else chosen_ranks(run):
        start = time.perf_counter()
        try:
            measure = measure_rank if shape is not None else measure_detector_rank
            coordinate, measured, traffic = measure(cfg, run, rank)
        except Exception as exc:
            raise DryRunError(
                f"rank {rank} of {run.describe()} failed to build or step: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if shape is not None:
            planned, planned_traffic = planned_rank(cfg, shape, run, coordinate)
        else:
            planned, planned_traffic = planned_detector(cfg, run)
        report = RankReport(rank, coordinate)
        report.figures = [Figure(k, v, planned.get(k)) for k, v in measured.items()]
        kinds = sorted(
            set(traffic) | set(planned_traffic), key=lambda k: ("pp dp tp world".find(k[:2]), k)
        )
        report.figures += [Figure(k, traffic.get(k, 0), planned_traffic.get(k)) for k in kinds]
        report.seconds = time.perf_counter() - start
        reports.append(report)
        if progress is not None:
            progress(report)
    return reports


class DryRunError(RuntimeError):
    """A rank of the layout could not be built or stepped by the training code."""
