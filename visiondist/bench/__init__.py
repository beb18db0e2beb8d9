"""tools/benchmark.py's harness: visiondist's training step timed side by side with plain PyTorch loops on the same
batches (`harness.py`, `plain_loop.py`), what it measures with (`measure.py`: timing with the device drained, peak
memory, FLOPs per image, synthetic batches), the devices' peak rates for MFU (`peaks.py`), and the result table and
RESULTS rows (`report.py`).

Imports: everything up to `train` (it times the trainer's own step).
"""
