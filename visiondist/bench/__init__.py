"""tools/benchmark.py's harness: visiondist's training step timed side by side with plain PyTorch
loops on the same batches (`harness.py`, `plain_loop.py`), what it measures with (`measure.py`:
steps timed on the device's stream with the training log's clock, peak memory, FLOPs per image,
synthetic batches), the result rows (`results.py`: MFU, ratios, loader and matcher shares) and their
table and RESULTS rows (`report.py`). The devices' peak rates for MFU are `visiondist.utils.peaks`
(the training log prints MFU too).

Imports: everything up to `train` (it times the trainer's own step).
"""
