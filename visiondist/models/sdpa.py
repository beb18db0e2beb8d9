"""Which kernel runs `scaled_dot_product_attention` in this process (`model.sdpa`).

torch tries its fused kernels in a fixed order (flash, memory-efficient, then the unfused math one;
cuDNN's only after math, so never): on Hopper cuDNN's attention can be the fastest and is never
picked. `model.sdpa=auto` on CUDA therefore times one block's attention, forward and backward, at
the run's shape (micro-batch, heads per tensor parallel rank, tokens, head size, the step's dtype)
with each fused kernel that runs it, and puts them in torch's order fastest first (`time_kernels`,
`select_attention(order=...)`); all stay allowed, so a shape the fastest cannot run (another batch,
evaluation) falls to the next. On the CPU auto keeps torch's order (its one fused kernel). A name
(`flash`, `efficient`, `cudnn`, `math`) allows only that kernel. The switches and the order are
torch's process-wide ones, so compiled graphs obey them too.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from visiondist.utils.clock import DeviceClock

_SWITCHES = {
    "flash": "enable_flash_sdp",
    "efficient": "enable_mem_efficient_sdp",
    "cudnn": "enable_cudnn_sdp",
    "math": "enable_math_sdp",
}
KERNELS = tuple(_SWITCHES)
_GET_ORDER = getattr(torch._C, "_get_sdp_priority_order", None)
_SET_ORDER = getattr(torch._C, "_set_sdp_priority_order", None)
_TORCH_ORDER = list(_GET_ORDER()) if _GET_ORDER is not None else None  # torch's own, as imported


def _backend(name: str):
    return {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def select_attention(kernel: str = "auto", order: Optional[Sequence[str]] = None) -> None:
    """Allow `kernel` only, or (`auto`) every kernel in torch's order, or in `order` (kernel names,
    first tried first; the rest follow in torch's order) where torch lets a process set it.

    Args:
        kernel: `model.sdpa`: auto, flash, efficient, cudnn or math.
        order: with auto, the kernels tried first, by name; None: torch's order.

    Raises:
        ValueError: an unknown kernel.
    """
    if kernel != "auto" and kernel not in _SWITCHES:
        raise ValueError(f"model.sdpa={kernel!r}: use auto or one of {', '.join(_SWITCHES)}")
    for name, switch in _SWITCHES.items():
        setter = getattr(torch.backends.cuda, switch, None)
        if setter is not None:
            setter(kernel in ("auto", name))
    if _SET_ORDER is None or _TORCH_ORDER is None:
        return
    first = [int(_backend(name)) for name in (order or ()) if kernel == "auto"]
    _SET_ORDER(first + [b for b in _TORCH_ORDER if b not in first])


def current_order() -> list[str]:
    """The kernels in the order torch tries them now (what `select_attention(..., order)` gives
    back)."""
    if _GET_ORDER is None:
        return []
    names = {int(_backend(n)): n for n in KERNELS}
    return [names[b] for b in _GET_ORDER() if b in names]


def _seconds_per_step(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """`steps` calls back to back, timed on the device (CUDA events on its stream; the host's clock
    on the CPU)."""
    clock = DeviceClock(device)
    clock.start()
    for _ in range(steps):
        step()
    clock.stop()
    return clock.seconds() / steps


def time_kernels(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    candidates: Sequence[str] = ("flash", "cudnn", "efficient"),
    steps: int = 10,
    warmup: int = 3,
) -> dict[str, Optional[float]]:
    """Seconds per forward + backward of attention on (batch, heads, tokens, head size) q, k, v for
    each candidate kernel; None where the kernel cannot run that shape, dtype or device (torch's "no
    available kernel")."""
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)
    out: dict[str, Optional[float]] = {}
    for name in candidates:

        def step() -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(grad)

        try:
            with sdpa_kernel([_backend(name)]):
                for _ in range(warmup):
                    step()
                out[name] = _seconds_per_step(step, steps, device)
        except RuntimeError:
            out[name] = None
    return out


def fastest_first(times: dict[str, Optional[float]]) -> list[str]:
    """The kernels that ran, fastest first."""
    ran = {n: t for n, t in times.items() if t is not None}
    return sorted(ran, key=ran.__getitem__)


def describe(times: dict[str, Optional[float]], shape: tuple[int, ...], dtype: torch.dtype) -> str:
    ran = fastest_first(times)
    seconds = {n: t for n, t in times.items() if t is not None}
    text = " < ".join(f"{n} {seconds[n] * 1e3:.3f} ms" for n in ran) or "no fused kernel runs it"
    cannot = [n for n, t in times.items() if t is None]
    dims = "x".join(str(s) for s in shape)
    return (
        f"attention (model.sdpa=auto): {text} per forward + backward at {dims} "
        f"{str(dtype).replace('torch.', '')}"
        + (f" ({', '.join(cannot)} cannot run it)" if cannot else "")
        + (f"; {ran[0]} runs first" if ran else "")
    )
