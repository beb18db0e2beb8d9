"""The two MFU denominators of `tools/benchmark.py` (the training log lines use the first): the
device's dense peak from its datasheet, and the dense matmul rate measured in the run.

Both in the precision the step's matmuls run in (`peak_kind`): bf16 autocast runs bf16 matmuls,
`trainer.precision=16` fp16 ones, fp32 runs TF32 on CUDA while `trainer.tf32` is on (the default)
and full fp32 otherwise. The datasheet figure is what the hardware can do at most; the measured one
is what this software stack reaches on a large square product (on the lent H100: 798 of 989.4 bf16
TFLOP/s), so MFU against it reads higher.
"""

from __future__ import annotations

import re
import time
from typing import Any, cast

import torch

# Dense (no 2:4 sparsity) peak TFLOP/s per GPU: (fp32 without tensor cores, tf32, bf16, fp16). The
# first pattern that
# matches torch.cuda.get_device_name() wins, so the NVL / PCIe boards come before the plain name
# (H100 SXM reports
# itself as "NVIDIA H100 80GB HBM3"). NVIDIA's tables list the tensor-core rates with sparsity;
# dense is half.
# - H100 SXM / PCIe: H100 datasheet (SXM 67 / 989* / 1979* / 1979*, PCIe 51 / 756* / 1513* / 1513*,
# "* with
# sparsity, 1/2 lower without"), as reproduced at
# archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html; the SXM
#   dense figures to one decimal (66.9, 494.7, 989.4) from the Hopper whitepaper via
#   glennklockwood.com/garden/processors/h100.
# - H100 NVL, H200 NVL (60 / 835* / 1671* / 1671*) and H200 SXM (67 / 989* / 1979* / 1979*):
# NVIDIA's H100 and H200
# product pages (www.nvidia.com/en-us/data-center/h100/, .../h200/), the same Hopper die at other
# clocks and power.
# - A100 SXM4 and PCIe, 40 and 80 GB (19.5 / 156 / 312 / 312): A100 datasheet
# nvidia-a100-datasheet-us-nvidia-1758950-
#   r4-web.pdf, via glennklockwood.com/garden/processors/A100.
# - L40S (91.6 / 183 / 362.05 / 362.05): L40S datasheet, as reproduced at mullet.se (product
# 355414).
# - A10 (31.2 / 62.5 / 125 / 125) and L4 (30.3 / 60 / 121 / 121): their datasheets (TF32 125* /
# 120*, BF16 and FP16
#   250* / 242*). The AWS A10G is another board and is not listed.
DATASHEET_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = tuple(
    (pattern, dict(zip(("fp32", "tf32", "bf16", "fp16"), rates)))
    for pattern, rates in (
        (r"\bH100\b.*\bNVL\b", (60.0, 417.5, 835.5, 835.5)),
        (r"\bH100\b.*\bPCIe\b", (51.0, 378.0, 756.5, 756.5)),
        (r"\bH100\b", (66.9, 494.7, 989.4, 989.4)),
        (r"\bH200\b.*\bNVL\b", (60.0, 417.5, 835.5, 835.5)),
        (r"\bH200\b", (66.9, 494.7, 989.4, 989.4)),
        (r"\bA100\b", (19.5, 156.0, 312.0, 312.0)),
        (r"\bL40S\b", (91.6, 183.0, 362.05, 362.05)),
        (r"\bA10\b", (31.2, 62.5, 125.0, 125.0)),
        (r"\bL4\b", (30.3, 60.0, 121.0, 121.0)),
    )
)

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
    for pattern, rates in DATASHEET_TFLOPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return rates[kind]
    return None


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
