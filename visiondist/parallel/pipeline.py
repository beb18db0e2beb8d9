"""Pipeline parallelism for models of blocks (the ViT) on `torch.distributed.pipelining`.

The plain model is cut into `pp x stages_per_rank` contiguous stages of blocks, balanced by
parameter count; what precedes the blocks (the ViT's patch embedding, class token and position
embedding) goes to the first stage, what follows them (its final norm and head, and the loss) to the
last: the model declares that split beside it (`visiondist.parallel.stages`; the ViT's cut is in
`visiondist.models.vit_parallel`). Stage modules hold the model's own submodules under the model's
attribute names (`blocks` keeps the global block indices), so parameter names are the single-device
ones and checkpoints stay canonical whatever `pp` is.

Rank `r` of the PP group holds stages r, r + pp, r + 2 pp, ... (the looped placement that torch's
interleaved and zero-bubble schedules expect). The schedules (GPipe, 1F1B, interleaved 1F1B,
interleaved zero-bubble) are torch's, built over a rank's stages by `visiondist.parallel.schedules`;
this module cuts, places, validates, and wraps them in `PipelinedViT`:

- training: `train_step(images, labels)` runs one schedule step; each micro-batch's loss is scaled
  by 1/m so the accumulated gradients are the batch mean, exactly what one process accumulating the
  same micro-batches computes. The schedule's stages carry no DDP wrapper: the trainer averages
  gradients over DP afterwards (one flat all-reduce, as Megatron does at the end of a pipeline
  flush), which works the same for every schedule, split backward included.
- evaluation: `predict` runs a forward-only schedule; batches are zero-padded to a fixed multiple of
  the micro-batch count, since a schedule's P2P buffers have fixed shapes.
- measurement: every forward / backward / input-grad / weight-grad action can be timed
  (`timeline()`), giving the bubble fraction and the PNG of `visiondist.parallel.timeline`.
- tensor parallelism composes inside a stage (the TP plan is applied before cutting); under sequence
  parallelism the token split / gather wraps each stage's blocks.
- ranks sharing one GPU over gloo (`trainer.share_gpu`): gloo's send and receive hand a tensor's
  data pointer to its TCP transport, host memory only, so there the stages exchange host tensors
  (`HostBoundary`): the schedule, its buffers and its shape exchange see CPU tensors, and each stage
  copies its input to the GPU and its output back.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from visiondist.config.layout import microbatches_for, stages_per_rank_for
from visiondist.parallel.schedules import P2PCounter, build_schedule
from visiondist.parallel.stages import (
    StageBlocks,
    block_ranges,
    build_stages,
    model_blocks,
    stage_cut,
    stage_indices,
    take_parts,
)
from visiondist.parallel.tensor import SequenceRegion
from visiondist.parallel.timeline import Recorder

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule

# torch.distributed.pipelining is imported where a pipeline is built (noqa: PLC0415): it brings
# torch._dynamo (0.7-1.2 s of every rank's start), which a run without a pipeline never needs.


def through_host(device: torch.device, backend: str) -> bool:
    """Whether the stages' neighbours exchange host tensors: CUDA stages over gloo (ranks sharing
    one GPU), whose send and receive take host memory only."""
    return device.type == "cuda" and backend == "gloo"


class HostBoundary(nn.Module):
    """A stage as the schedule sees it when its neighbours' tensors travel through host memory: its
    input copied to `device` and its output back to the host, both as autograd copies, so the input
    gradient the schedule sends back is a host tensor too. The parameters are the stage's own
    (`inner`)."""

    def __init__(self, inner: nn.Module, device: torch.device):
        super().__init__()
        self.inner, self.device = inner, device

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.inner(*(a.to(self.device, copy=True) for a in args))
        return out.to("cpu", copy=True)


# -- the pipelined model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineSpec:
    """A pipeline as it runs, every value concrete (the run's `RunLayout`, or `PipelineSpec.of` for
    a bare model).

    Attributes:
        schedule: torch's schedule: gpipe, 1f1b, interleaved_1f1b or zero_bubble.
        stages_per_rank: virtual stages on each rank (2 and more: the interleaved schedules).
        microbatches: micro-batches per schedule step, per DP rank.
        host_boundary: the stages exchange host tensors; None: where `through_host` says.
    """

    schedule: str = "1f1b"
    stages_per_rank: int = 1
    microbatches: int = 2
    # the stages exchange host tensors; None: where `through_host` says
    host_boundary: Optional[bool] = None

    @classmethod
    def of(
        cls, pp: int, schedule: str = "1f1b", stages_per_rank: int = -1, microbatches: int = -1
    ) -> PipelineSpec:
        """With `parallel.*`'s defaults filled in: 2 stages per rank for the interleaved and
        zero-bubble schedules, 2 x pp micro-batches.

        Args:
            pp: pipeline-parallel degree.
            schedule: torch's schedule name.
            stages_per_rank: virtual stages per rank; -1: the schedule's default.
            microbatches: micro-batches per step; -1: 2 x pp.
        """
        return cls(
            schedule,
            stages_per_rank_for(schedule, stages_per_rank),
            microbatches_for(pp, microbatches),
        )

    @classmethod
    def from_layout(cls, run) -> PipelineSpec:
        """The pipeline of a `RunLayout`.

        Args:
            run: the job's `RunLayout`.
        """
        return cls(run.schedule, run.stages_per_rank, run.microbatches)


class PipelinedViT(nn.Module):
    """This rank's share of a VisionTransformer cut into pipeline stages, run by one of torch's
    schedules.

    Its own parameters are those of its stages under the single-device names (`patch_embed.*` on the
    first rank, `blocks.<i>.*` of its blocks, `norm.*` / `head.*` on the last), so optimizers,
    gradient clipping and checkpoints treat it like the plain model. `train_step` runs one schedule
    step (every rank of the pipeline group calls it; the first stage passes the images, the last the
    labels); `predict` runs the forward-only pipeline.

    Args:
        model: the plain ViT classifier (its tensor-parallel plan already applied when tp > 1).
        layout: this rank's `Layout`.
        spec: the schedule, stages per rank and micro-batches (`PipelineSpec`).
        loss_fn: the loss of the last stage, `loss_fn(logits, labels)`.
        sequence_parallel: the stages' blocks sequence parallel (tp > 1).
    """

    def __init__(
        self,
        model: nn.Module,
        layout,
        spec: PipelineSpec,
        loss_fn: Callable = F.cross_entropy,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        pp = layout.pp
        # checked when the layout was resolved
        spr, self.microbatches = spec.stages_per_rank, spec.microbatches
        depth = len(model_blocks(model))
        if pp * spr > depth or spr < 1 or self.microbatches < pp:
            raise ValueError(
                f"{spec} does not fit pp={pp} and {depth} blocks (resolve it with "
                "visiondist.plan.resolve, which names the fix)"
            )
        self.schedule_name, self.stages_per_rank = spec.schedule, spr
        self.n_stages = pp * spr
        self.layout, self.device, self.group = layout, layout.device, layout.mesh.get_group("pp")
        self.host_boundary = (
            through_host(self.device, dist.get_backend(self.group))
            if spec.host_boundary is None
            else spec.host_boundary
        )
        # where the schedule's tensors are
        self.wire = torch.device("cpu") if self.host_boundary else self.device
        self.stage_ids = stage_indices(layout.pp_rank, pp, spr)
        self.ranges = block_ranges(model, self.n_stages)
        self.is_first, self.is_last = 0 in self.stage_ids, self.n_stages - 1 in self.stage_ids
        stages = build_stages(model, layout.pp_rank, pp, spr, self.ranges)
        # this rank's parameters, registered under the model's own names
        self.cut = stage_cut(model)
        take_parts(self, model, self.cut.first if self.is_first else ())
        self.blocks = StageBlocks(
            {i: block for stage in stages for i, block in stage.blocks.items()}
        )
        take_parts(self, model, self.cut.last if self.is_last else ())
        # the token split / gather that wraps the model's `blocks` now wraps each stage's
        if sequence_parallel:
            for stage in stages:
                SequenceRegion().apply(stage.blocks, layout.tp_comm, True)
        self._stages = stages  # a plain list: their parameters are already registered above
        self._scheduled = (
            [HostBoundary(s, self.device) for s in stages] if self.host_boundary else stages
        )
        self._loss_fn = loss_fn
        self._loss_scale: float | torch.Tensor = 1.0
        self.recorder = Recorder(layout.pp_rank, layout.device)
        self.p2p = P2PCounter()  # sends of the training schedule
        self._schedule = self._training_schedule()
        self._eval_schedule: Optional[_PipelineSchedule] = None
        self._enter: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        # a dry run: keep how the first stage enters (no memory)
        if all(p.is_meta for p in model.parameters()):
            self._enter = lambda images: self.cut.enter(model, images)

    def use_static_shapes(self, images: torch.Tensor) -> None:
        """Rebuild the training schedule with every stage's input and output shapes for
        micro-batches like `images` (on the meta device), so the stages exchange no shapes at the
        first step: a dry run's fake process group carries no data. Only for a model built on the
        meta device."""
        if self._enter is None:
            raise ValueError(
                "static pipeline shapes are for a model built on the meta device (the dry run)"
            )
        # every stage boundary carries what the first stage's blocks take, and its gradient back
        # (meta: no memory)
        boundary = self._enter(images).detach().requires_grad_(True)
        shapes = []
        for stage, index in zip(self._stages, self.stage_ids):
            given = images if index == 0 else boundary
            shapes.append((given, stage(given)))
        self._schedule = self._training_schedule(shapes)

    def _training_schedule(self, shapes: Optional[Sequence[tuple]] = None) -> _PipelineSchedule:
        """The training schedule over this rank's stages; `shapes`: each stage's (input, output)
        for static shapes (`use_static_shapes`), else exchanged at the first step."""
        return build_schedule(
            self.schedule_name,
            self._scheduled,
            self.stage_ids,
            self.n_stages,
            self.microbatches,
            self.wire,
            self.group,
            self._scaled_loss,
            self.recorder,
            scale_grads=False,
            counter=self.p2p,
            shapes=shapes,
        )

    def no_weight_decay(self) -> set[str]:
        return set(self.cut.no_weight_decay) if self.is_first else set()

    def describe(self) -> str:
        blocks = ", ".join(f"stage {s}: blocks {a}-{b - 1}" for s, (a, b) in enumerate(self.ranges))
        return (
            f"pipeline {self.schedule_name}, {self.n_stages} stages ({self.stages_per_rank} per "
            f"rank), {self.microbatches} micro-batches | {blocks}"
        )

    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.host_boundary:  # the loss where the model computes
            output, target = output.to(self.device), target.to(self.device)
        return self._loss_fn(output.float(), target) * self._loss_scale

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "a pipelined model runs through train_step() and predict(), not model(x)"
        )

    def train_step(
        self,
        images: Optional[torch.Tensor],
        labels: Optional[torch.Tensor],
        scale: float | torch.Tensor = 1.0,
        autocast=None,
    ) -> torch.Tensor:
        """Forward and backward of one batch in `microbatches` micro-batches; gradients accumulate
        into `.grad` (the loss of each micro-batch is scaled by scale / microbatches; a tensor
        `scale` carries fp16's loss scale into the schedule's backward). `labels` is the loss
        function's target (class indices or soft targets), split into micro-batches like the images.
        Returns the batch's mean loss times `scale`, the same on every rank of the pipeline
        group.

        Args:
            images: the batch's images on the first stage; None on the others.
            labels: the batch's targets on the last stage; None on the others.
            scale: multiplies the loss (fp16's loss scale, or 1).
            autocast: the precision's autocast context; None: none.
        """
        if self.is_first and images is None:
            raise ValueError("the first pipeline stage needs the images")
        if self.is_last and labels is None:
            raise ValueError("the last pipeline stage needs the labels")
        self._loss_scale = scale / self.microbatches
        losses: list[torch.Tensor] = []
        # a copy to the host must have landed before the schedule reads it
        fast = not self.host_boundary
        # (checked above: the first stage has images, the last labels)
        args = (
            (images.to(self.wire, non_blocking=fast),)
            if self.is_first and images is not None
            else ()
        )
        target = (
            labels.to(self.wire, non_blocking=fast) if self.is_last and labels is not None else None
        )
        with autocast or nullcontext():
            self._schedule.step(*args, target=target, losses=losses, return_outputs=False)
        loss = (
            torch.stack([x.detach().float() for x in losses]).sum()
            if losses
            else torch.zeros((), device=self.device)
        )
        return self.from_last_stage(loss)

    def from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as the last stage holds it, on every rank of the pipeline group (others
        contribute zeros)."""
        if not self.is_last:
            tensor = torch.zeros_like(tensor)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    @torch.no_grad()
    def predict(
        self, images: Optional[torch.Tensor], count: Optional[int], batch_size: int, autocast=None
    ) -> Optional[torch.Tensor]:
        """Logits of one evaluation batch, forward only. Every rank of the pipeline group calls it
        with the same `batch_size` (the loader's); the first stage passes the images, which are
        zero-padded to a fixed multiple of the micro-batch count (a last, smaller batch included).
        The last stage gets the `count` real rows' logits; the other ranks get None.

        Args:
            images: the batch's images on the first stage; None on the others.
            count: how many rows are real (the rest is padding).
            batch_size: the loader's batch size, the same on every rank of the group.
            autocast: the precision's autocast context; None: none.
        """
        padded = -(-batch_size // self.microbatches) * self.microbatches
        args: tuple[torch.Tensor, ...] = ()
        if self.is_first:
            if images is None:
                raise ValueError("the first pipeline stage needs the images")
            if len(images) > padded:
                raise ValueError(
                    f"an evaluation batch of {len(images)} exceeds the batch size {batch_size}"
                )
            images = images.to(self.wire, non_blocking=not self.host_boundary)
            if len(images) < padded:
                images = torch.cat(
                    [images, images.new_zeros((padded - len(images), *images.shape[1:]))]
                )
            args = (images,)
        if self._eval_schedule is None:  # forward only: the same stages, no loss
            self._eval_schedule = build_schedule(
                self.schedule_name,
                self._scheduled,
                self.stage_ids,
                self.n_stages,
                self.microbatches,
                self.wire,
                self.group,
                None,
            )
        with autocast or nullcontext():
            out = self._eval_schedule.step(*args)
        if not self.is_last:
            return None
        return out[:count].to(self.device)

    @contextmanager
    def timeline(self):
        """Record the next schedule step's actions (see `visiondist.parallel.timeline`)."""
        with self.recorder.record(barrier=lambda: dist.barrier(group=self.group)) as recorder:
            yield recorder
