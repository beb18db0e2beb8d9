"""Host values on the device without a host-device synchronisation: what the device-side data work
(augmentation, JPEG decoding) copies its per-sample arguments with. Below every other module of
`data/` that runs on the device."""

from __future__ import annotations

import torch


def host_to(values, device: torch.device, dtype=None) -> torch.Tensor:
    """Host values on `device` without a host-device synchronisation: a CUDA copy from pinned memory
    is asynchronous (one from pageable memory waits for the stream first)."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
