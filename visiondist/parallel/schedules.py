"""torch's pipeline schedules (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble) over one
rank's stages, as `PipelinedViT` (`visiondist.parallel.pipeline`) runs them: each stage a
`PipelineStage` that can time its forward / backward / input-grad / weight-grad actions for the
timeline (`visiondist.parallel.timeline.Recorder`) and count the bytes it sends its neighbours
(`P2PCounter`, against `p2p_bytes_per_step`'s figure).

torch.distributed.pipelining is imported where a schedule is built (noqa: PLC0415): it brings
torch._dynamo (0.7-1.2 s of every rank's start), which a run without a pipeline never needs.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn

from visiondist.compat import check_pipeline_stage
from visiondist.config.layout import MULTI_STAGE, SCHEDULES
from visiondist.parallel.timeline import Recorder

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule


_SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}


def _schedule_class(name: str):
    from torch.distributed.pipelining import schedules  # noqa: PLC0415 (dynamo: see the top)

    if name not in _SCHEDULE_CLASSES:
        raise ValueError(
            f"parallel.schedule={name!r} is not supported: use one of {', '.join(SCHEDULES)}"
        )
    cls = getattr(schedules, _SCHEDULE_CLASSES[name], None)
    if cls is None:
        raise RuntimeError(
            f"parallel.schedule={name} needs "
            f"torch.distributed.pipelining.{_SCHEDULE_CLASSES[name]}, which PyTorch "
            f"{torch.__version__} lacks: use parallel.schedule=1f1b (or upgrade PyTorch)"
        )
    return cls


class P2PCounter:
    """Bytes and messages this rank's stages send to their neighbours: activations forward, input
    gradients backward (what the schedule actually hands to `isend`)."""

    def __init__(self) -> None:
        self.bytes, self.sends = 0, 0

    def count(self, ops) -> None:
        for op in ops:
            self.bytes += op.tensor.numel() * op.tensor.element_size()
            self.sends += 1

    def reset(self) -> None:
        self.bytes, self.sends = 0, 0


def p2p_bytes_per_step(
    model_stages: Sequence[int], n_stages: int, microbatches: int, activation_bytes: int
) -> int:
    """What a rank holding `model_stages` sends per schedule step: every micro-batch's activation
    out of each of its stages but the last, and its input gradient (the same size) out of each but
    the first."""
    sends = sum(int(s < n_stages - 1) + int(s > 0) for s in model_stages)
    return sends * microbatches * activation_bytes


def _timed_stage_class():
    """`PipelineStage` that reports each forward / backward of a micro-batch to a `Recorder` and
    counts its sends."""
    from torch.distributed.pipelining import PipelineStage  # noqa: PLC0415 (dynamo: see the top)

    # it overrides private methods: a torch release that changed them fails here, by name
    check_pipeline_stage()

    class TimedStage(PipelineStage):
        recorder: Optional[Recorder] = None
        counter: Optional[P2PCounter] = None

        def get_fwd_send_ops(self, fwd_chunk_id):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            if self.counter is not None:
                self.counter.count(ops)
            return ops

        def get_bwd_send_ops(self, bwd_chunk_id):
            ops = super().get_bwd_send_ops(bwd_chunk_id)
            if self.counter is not None:
                self.counter.count(ops)
            return ops

        def _action(self, phase: str, microbatch: int):
            return (
                self.recorder.action(self.stage_index, phase, microbatch)
                if self.recorder
                else nullcontext()
            )

        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with self._action("F", fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(
            self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False
        ):
            with self._action("B" if full_backward else "I", bwd_chunk_id):
                return super().backward_one_chunk(
                    bwd_chunk_id,
                    loss=loss,
                    full_backward=full_backward,
                    last_backward=last_backward,
                )

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            with self._action("W", bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    return TimedStage


def build_schedule(
    name: str,
    stages: Sequence[nn.Module],
    stage_ids: Sequence[int],
    n_stages: int,
    microbatches: int,
    device: torch.device,
    group,
    loss_fn: Optional[Callable],
    recorder: Optional[Recorder] = None,
    scale_grads: bool = True,
    counter: Optional[P2PCounter] = None,
    shapes: Optional[Sequence[tuple]] = None,
) -> _PipelineSchedule:
    """torch's schedule `name` over this rank's stages; with a `recorder`, every action is timed;
    with a `counter`, every send is counted; with `shapes` ((input, output) example tensors per
    stage), the stages exchange no shapes (a fake process group cannot)."""
    cls = _schedule_class(name)
    stage_cls = _timed_stage_class()
    pipe_stages = []
    for i, (module, index) in enumerate(zip(stages, stage_ids)):
        static = {"input_args": shapes[i][0], "output_args": shapes[i][1]} if shapes else {}
        stage = stage_cls(module, index, n_stages, device, group=group, **static)
        stage.recorder, stage.counter = recorder, counter
        pipe_stages.append(stage)
    if name in MULTI_STAGE:
        return cls(
            pipe_stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads
        )
    if len(pipe_stages) != 1:
        raise ValueError(
            f"parallel.schedule={name} runs one stage per rank: set parallel.stages_per_rank=1"
        )
    return cls(
        pipe_stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads
    )
