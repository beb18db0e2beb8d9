"""How a rank trains: the loop and everything it is built from.

- `run.py`: the entry points every rank runs (`train` for tools/train.py, `evaluate_checkpoint` for tools/eval.py);
- `components.py`: a rank's parts built once (task and data, laid-out model, optimizer, EMA, schedule, precision);
  `build.py` (the laid-out model, seeds, the rank's logging and data), `optim.py`, `precision.py`, `ema.py`;
- `trainer.py`: the loop; `step.py`: one optimizer step and its health verdicts; `resume.py`: the trainer's
  checkpoints; `hooks.py`: the periodic concerns, one class each (progress, logging, timeline, ...) and their order;
  `results_hooks.py`: those that decide what a run leaves (checkpoints, the best, weights, evaluation);
- `tasks.py`: what differs between classification and detection (data, loss, evaluation, plots);
- `summary.py`: what the trainer says at start-up and in the end-of-run summary.

Imports: everything below it (data, models, parallel, checkpoint, observe, faults, evaluation). Only the benchmark,
the dry run and the launcher import it.
"""
