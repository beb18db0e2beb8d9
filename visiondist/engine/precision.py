"""Mixed precision (`trainer.precision`): the autocast dtype, and fp16's dynamic loss scaling with
one verdict for the whole job.

fp16 keeps 5 exponent bits: gradients below 6e-8 flush to zero and values above 65504 overflow. The
loss is multiplied by a scale S before the backward, which lifts small gradients into range, and the
gradients are divided by S again before anything reads them (the global norm, clipping, the
optimizer). When a scaled gradient overflows (inf/NaN) the optimizer step is skipped and S halves;
after 2000 finite steps in a row S doubles. That is `torch.amp.GradScaler` with its defaults (S
starts at 2^16), which `LossScaler` is.

What it changes: the inf/NaN decision. GradScaler checks this rank's gradients. Under tensor or
pipeline parallelism each rank holds different gradients, so one rank can find an inf where another
does not; one would skip the step while the other steps, and the replicas diverge.
`LossScaler.agree` replaces the rank's own finding with the step's verdict from `StepHealth` (its
flags are all-reduced over the world every step anyway: a loss or the global gradient norm not
finite), so every rank skips the same steps and moves its scale identically, with no extra
collective and without the host reading the flag: a fused optimizer skips on the device, torch's
other kernels read the flag (as they do under GradScaler).

FSDP2: GradScaler unscales DTensor gradients as they are (DTensor runs the unscale kernel on each
local shard and reduces its inf flag over the mesh).
`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` does the same and then all-reduces
the flag once more over its process group; since the flag is replaced by the job's verdict, plain
GradScaler serves every layout.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.cpu
from omegaconf import DictConfig

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}


def precision_name(precision) -> str:
    """`trainer.precision` as a string: Hydra hands `trainer.precision=16` over as the int 16, the
    YAML as "16"."""
    return str(precision)


def autocast_dtype(precision) -> torch.dtype | None:
    """The dtype autocast runs matmuls and convolutions in; None for fp32."""
    return AUTOCAST_DTYPES.get(precision_name(precision))


def autocast_for(precision, device: torch.device):
    dtype = autocast_dtype(precision)
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


class LossScaler(torch.amp.GradScaler):
    """`torch.amp.GradScaler` whose inf/NaN finding is the job's, not the rank's (see the module
    docstring).

    Per step: `scale(loss).backward()` (or the pipeline's loss times `factor()`),
    `unscale_(optimizer)`, the global norm and clipping, `agree(optimizer, verdict)`,
    `step(optimizer)`, `update()`. `state_dict()` (scale, growth tracker) is the same on every rank
    and goes into the checkpoint's trainer state."""

    def __init__(self, device: torch.device, **kwargs):
        super().__init__(device.type, **kwargs)

    def factor(self, device: torch.device) -> torch.Tensor:
        """The current scale as a 0-dim tensor on `device`, without a host read: what a loss
        computed where `scale()` cannot be called (inside a pipeline schedule) is multiplied by."""
        return self.scale(torch.ones((), device=device))

    def agree(self, optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
        """After `unscale_(optimizer)`: take `nonfinite` (a 0-dim tensor, > 0 when the step must be
        skipped, the same on every rank) as the inf/NaN finding that `step` and `update` act on, in
        place of this rank's own. GradScaler keeps the finding in its per-optimizer state (private,
        its shape unchanged since torch 1.6; the smoke tests exercise this on torch 2.11 as
        well)."""
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not found:
            raise RuntimeError(
                "LossScaler.agree comes after unscale_(optimizer), which found no gradients"
            )
        for flag in found.values():
            flag.copy_(nonfinite.reshape(flag.shape))


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (x86: AVX512-BF16 or AMX; Arm: the BF16
    extension); without it torch emulates bf16 matmuls, many times slower than fp32."""
    checks = [
        getattr(torch.cpu, name, None)
        for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    ]
    if any(check is not None and check() for check in checks):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def set_tf32(enabled: bool) -> None:
    """fp32 matmuls and convolutions on CUDA in TF32 (`trainer.tf32`): several times the fp32 rate
    on A100 / H100, with a 10-bit mantissa; off: full fp32 ("ieee")."""
    precision = "tf32" if enabled else "ieee"
    torch.backends.cuda.matmul.fp32_precision = precision
    # torch makes this module a `CudnnModule` at import, whose `conv` its stubs do not declare
    torch.backends.cudnn.conv.fp32_precision = precision  # type: ignore[attr-defined]


PRECISIONS = {"32": "fp32", "bf16": "bf16 autocast", "16": "fp16 autocast + loss scaling"}


def precision_text(
    trainer_cfg: DictConfig, device: torch.device, model: torch.nn.Module | None = None
) -> str:
    """What `trainer.precision` (and `trainer.tf32`) run as, for the start-up line and the summary;
    with `model`, how many of its linear layers float8 converted (`trainer.fp8_layers` may pick
    none)."""
    text = PRECISIONS[precision_name(trainer_cfg.precision)]
    if trainer_cfg.get("fp8", "off") != "off":
        count = (
            None
            if model is None
            else sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        )
        text += (
            f" + fp8 {trainer_cfg.fp8} (the blocks' linear layers)"
            if count is None
            else f" + fp8 {trainer_cfg.fp8} ({count} linear layers)"
            if count
            else f" (trainer.fp8={trainer_cfg.fp8} converted no layer)"
        )
    return (
        text + " (TF32 matmuls)"
        if text == "fp32" and device.type == "cuda" and trainer_cfg.tf32
        else text
    )
