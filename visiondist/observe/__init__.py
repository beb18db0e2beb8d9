"""What people see and what a run leaves: the console and the run's log (`console.py`), metrics.csv
with TensorBoard and the experiment trackers (`metrics.py`, `trackers.py`: a new tracker is a class
there, a row of its `KINDS` and its package in `config.validate.TRACKERS`), progress bars
(`progress.py`), the end-of-run summary table and summary.json (`summary.py`) and the PNG plots
(`plots.py`).

Imports: `utils` and `config` only (it shows what others measured; it measures nothing itself).
"""
