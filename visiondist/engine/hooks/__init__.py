"""The training loop's hooks: each concern with its own cadence and its own fields of the loop
state.

- `periodic.py`: the progress bar, the collective timeout, the stop check, the traffic counters, the
  log line, the pipeline timeline;
- `results.py`: what a run leaves (checkpoints, the best, the weights) and the evaluations the best
  is chosen by;
- `compile.py`: what `trainer.compile` did (dynamo's graphs, graph breaks and recompile-limit hits);
- `default.py`: their order, with the reason for each place.

The interface (`Hook`) is the loop's own (`visiondist.engine.trainer`); the loop never imports a
hook: the layer above hands them in (`visiondist.engine.run.build_trainer`).
"""

from visiondist.engine.hooks.default import default_hooks

__all__ = ["default_hooks"]
