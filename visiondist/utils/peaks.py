"""The two MFU denominators of `tools/benchmark.py` (the training log lines use the first): the
device's dense peak from its datasheet (`utils/gpus.py`), and the dense matmul rate measured in the
run.

Both in the precision the step's matmuls run in (`peak_kind`): bf16 autocast runs bf16 matmuls,
`trainer.precision=16` fp16 ones, fp32 runs TF32 on CUDA while `trainer.tf32` is on (the default)
and full fp32 otherwise. The datasheet figure is what the hardware can do at most; the measured one
is what this software stack reaches on a large square product (on the lent H100: 798 of 989.4 bf16
TFLOP/s), so MFU against it reads higher.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch

from visiondist.utils.gpus import board_of_device

_DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "tf32": torch.float32,
    "fp32": torch.float32,
}


def peak_kind(precision: str, tf32: bool, device: torch.device) -> str:
    """The matmul precision of a step: "bf16", "fp16" (`trainer.precision=16`), "tf32" (fp32 on CUDA
    with `trainer.tf32`) or "fp32"."""
    precision = str(precision)  # Hydra hands `trainer.precision=16` over as the int 16
    if precision == "bf16":
        return "bf16"
    if precision == "16":
        return "fp16"
    return "tf32" if tf32 and device.type == "cuda" else "fp32"


def datasheet_tflops(name: str, kind: str) -> float | None:
    """The datasheet's dense peak of the device called `name` (torch.cuda.get_device_name) in
    `kind`; None for a device the table does not know (every CPU)."""
    board = board_of_device(name)
    return None if board is None else board.peak(kind)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, kind: str, repeats: int = 10) -> float:
    """Dense matmul rate of this device in `kind`, in TFLOP/s: the best of `repeats` square products
    of each size (8192 on a GPU; 1024 and 2048 on the CPU, whose caches favour the smaller), with
    this process's threads. On CUDA "tf32" and "fp32" multiply fp32 tensors with TF32 on and off
    (the process's switch is restored after)."""
    if device.type != "cuda" or kind not in ("tf32", "fp32"):
        return _best_matmul(device, _DTYPES[kind], repeats)
    conv = cast(Any, torch.backends.cudnn).conv  # torch's annotations of the module leave it out
    before = torch.backends.cuda.matmul.fp32_precision, conv.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = conv.fp32_precision = (
        "tf32" if kind == "tf32" else "ieee"
    )
    try:
        return _best_matmul(device, torch.float32, repeats)
    finally:
        torch.backends.cuda.matmul.fp32_precision, conv.fp32_precision = before


# on the CPU, a kind whose 1024-square product would take longer is measured at 512
SLOW_PRODUCT_S = 0.5


def _best_matmul(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    best = 0.0
    sizes = (8192,) if device.type == "cuda" else (1024, 2048)
    if (
        device.type != "cuda"
        and 2 * 1024**3 / (1e12 * _rate(device, dtype, 256, 0)) > SLOW_PRODUCT_S
    ):
        # e.g. bf16 on a CPU without its instructions (1 GFLOP/s here): 2048 would take minutes
        sizes = (512,)
    for size in sizes:
        best = max(best, _rate(device, dtype, size, repeats))
    return best


def _rate(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    """The best TFLOP/s of `repeats` square products of `size` after two warm-up products (one
    product when 0)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = 0.0
    warm = 2 if repeats else 0
    for i in range(max(1, repeats) + warm):
        _synchronize(device)
        start = time.perf_counter()
        a @ b
        _synchronize(device)
        if i >= warm:
            best = max(best, 2 * size**3 / (time.perf_counter() - start) / 1e12)
    return best
