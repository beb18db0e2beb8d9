"""How a rank trains: the loop, the parts it holds and the hooks it runs.

- `run.py`: the entry points every rank runs (`train` for tools/train.py, `evaluate_checkpoint` for
  tools/eval.py) and `build_trainer`, which builds the parts, the loop state and the hooks and hands
  them to the loop;
- `components.py`: a rank's parts built once (task and data, laid-out model, optimizer, EMA,
  schedule, precision); `build.py` (the laid-out model, seeds, the rank's logging and data),
  `optim.py`, `precision.py`, `ema.py`, `fp8.py`;
- `trainer.py`: the loop and the hooks' interface (`Hook`); `state.py`: the one typed `LoopState`
  (each field with one owner) and the step timer; the parts the loop holds: `step.py` (one optimizer
  step and its health verdicts), `checkpointing.py` (resuming and saving), `validation.py`
  (evaluations between steps), `utilisation.py` (MFU);
- `hooks/`: the periodic concerns, one class each (progress, logging, timeline, checkpoints,
  evaluation, ...) and their order;
- `tasks.py`: what differs between classification and detection (data, loss, evaluation, plots);
- `summary.py`: what a run says at start-up and in its end-of-run summary, read off the parts and
  the loop state.

Imports: everything below it (data, models, parallel, checkpoint, observe, faults, evaluation). Only
the benchmark, the dry run and the launcher import it.
"""
