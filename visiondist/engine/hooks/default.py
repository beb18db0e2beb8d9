"""The hooks of a training run, in their order (`default_hooks`), with the reason for each place."""

from __future__ import annotations

from visiondist.engine.hooks.compile import CompileHook
from visiondist.engine.hooks.periodic import (
    LogHook,
    ProgressHook,
    StopHook,
    TimelineHook,
    TimeoutHook,
    TrafficHook,
)
from visiondist.engine.hooks.results import (
    BestCheckpointHook,
    CheckpointHook,
    EvalHook,
    WeightsHook,
)
from visiondist.engine.trainer import Hook


def default_hooks() -> list[Hook]:
    """The hooks every training run has, in the order the loop runs them.

    In this order, for a reason each:
    - progress first, so the bar shows the step even if a later hook fails on it;
    - the collective timeout right after the first step, before anything else can hang on a
      collective;
    - traffic and the log line next: they describe the step just run (a stopped job's last step too:
      metrics.csv has every step the checkpoint holds);
    - the stop check before the rest of the per-step work, so a stopped job spends nothing more than
      its checkpoint (the hooks after it do not see its last step: neither the timeline nor the
      evaluation);
    - the timeline after them: its gathering is not training time;
    - the checkpoint before the evaluation, and (at the end) the weights between them: a failing
      evaluation loses neither the checkpoint nor the weights;
    - the best checkpoint after the evaluation it is chosen by;
    - the compile timer last: it times the first step alone.

    Returns:
        A new list of new hooks (a run's own: some hold state), which `run.build_trainer` hands to
        the loop.
    """
    return [
        ProgressHook(),
        TimeoutHook(),
        TrafficHook(),
        LogHook(),
        StopHook(),
        TimelineHook(),
        CheckpointHook(),
        WeightsHook(),
        EvalHook(),
        BestCheckpointHook(),
        CompileHook(),
    ]
