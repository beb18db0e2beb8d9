"""What goes wrong and how a rank ends: the step's health (`health.py`: non-finite loss or gradient,
stop signals, the collective timeout) and the failure record and hang watchdog (`failures.py`: one
line naming the rank, the step and the cause; stacks of a hung rank). The launcher starts the
watchdog (`visiondist.launch`), the trainer's `TimeoutHook` (`visiondist.engine.hooks`) shortens its
limit after the first step, and it reads the heartbeat every long task beats
(`visiondist.utils.heartbeat`).

Imports: `compat`, `utils` and `observe` (the run's log file gets the failure line)
(tests/unit/test_layers.py).
"""
