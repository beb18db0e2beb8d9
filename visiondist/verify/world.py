"""The dry run's world: torch's fake process group at the job's world size (every collective
accepted, nothing moved), a dispatch mode that counts every collective's payload per mesh dimension
(`Traffic`), and a function mode that emulates autocast on meta tensors (`AsOnDevice`)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from visiondist.parallel import local_numel


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as `rank` of `world_size` on torch's fake process group (for CPU and meta
    tensors)."""
    devices = dist.Backend.backend_capability.setdefault("fake", ["cpu"])
    if "meta" not in devices:
        devices.append("meta")  # the pipeline's sends carry meta tensors
    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


_KINDS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "send": "send",
    "recv": "recv",
    "broadcast": "broadcast",
    "tp_all_reduce": "all_reduce",
    "tp_all_gather": "all_gather",
    "tp_reduce_scatter": "reduce_scatter",
}


def _kind(op_name: str) -> Optional[str]:
    namespace, _, name = op_name.partition(".")
    if namespace not in ("c10d", "_c10d_functional", "visiondist"):
        return None
    name = (
        name.split(".")[0]
        .strip("_")
        .replace("_base", "")
        .replace("_into_tensor", "")
        .replace("_tensor", "")
    )
    for key, kind in _KINDS.items():
        if name.startswith(key):
            return kind
    return None


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def nbytes(t: torch.Tensor) -> int:
    return local_numel(t) * t.element_size()


class Traffic(TorchDispatchMode):
    """Bytes of each collective call, keyed "<mesh dim> <kind>": the payload (the largest tensor an
    all-gather or reduce-scatter touches; every tensor an all-reduce, send or receive carries). The
    TP ops are counted as such; the c10d calls inside them are not seen again."""

    def __init__(self, groups: dict, other: str = "world"):
        super().__init__()
        self.groups = groups  # process group -> mesh dim name
        self.other = other  # the name of any other group's traffic
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def _dim(self, args, op_name: str) -> str:
        if op_name.startswith("visiondist."):
            return "tp"
        for arg in args:
            name = self.groups.get(_group_key(arg))
            if name is not None:
                return name
        return self.other

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = _kind(str(func))
        if kind is not None:
            tensors = _tensors(list(args)) + _tensors(out)
            size = (
                sum(map(nbytes, _tensors(args[0])))
                if kind in ("all_reduce", "send", "recv", "broadcast")
                else max(map(nbytes, tensors), default=0)
            )
            key = f"{self._dim(args, str(func))} {kind}"
            self.bytes[key] = self.bytes.get(key, 0) + size
            self.calls[key] = self.calls.get(key, 0) + 1
        return out


def _group_key(arg) -> Optional[int]:
    if isinstance(arg, dist.ProcessGroup):
        return id(arg)
    unwrap = getattr(dist.ProcessGroup, "unbox", None)
    if unwrap is not None and type(arg).__name__ == "ScriptObject":
        try:
            return id(unwrap(arg))
        except Exception:  # not a process group
            return None
    return None


LOW_PRECISION_OPS = (
    F.linear,
    F.conv2d,
    F.scaled_dot_product_attention,
    torch.matmul,
    torch.bmm,
    torch.mm,
    torch.addmm,
    torch.baddbmm,
)
FP32_OPS = (F.layer_norm, F.softmax, F.log_softmax, F.cross_entropy)  # autocast runs these in fp32


class AsOnDevice(TorchFunctionMode):
    """Meta and fake tensors computing as a GPU would, for what autograd saves: autocast (torch has
    none for them), by casting the fp32 inputs of the ops autocast runs in its lower precision
    (matmuls, convolutions, attention; norms and softmax stay fp32); and fused attention (saving q,
    k, v, the output and its log-sum-exp, as the flash and memory-efficient kernels do, where meta
    tensors would take the unfused path and save the tokens x tokens matrix), unless
    `model.sdpa=math` asks for the unfused one."""

    def __init__(self, dtype: Optional[torch.dtype], fused_attention: bool = True):
        super().__init__()
        self.dtype, self.fused_attention = dtype, fused_attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.dtype is not None and func in LOW_PRECISION_OPS:

            def cast(x):
                return (
                    x.to(self.dtype)
                    if isinstance(x, torch.Tensor) and x.dtype == torch.float32
                    else x
                )

            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        if self.dtype is not None and func in FP32_OPS:

            def widen(x):
                return x.float() if isinstance(x, torch.Tensor) and x.dtype == self.dtype else x

            args = tuple(widen(a) for a in args)
            kwargs = {k: widen(v) for k, v in kwargs.items()}
        if (
            func is F.scaled_dot_product_attention
            and self.fused_attention
            and len(args) == 3
            and all(v is None for v in kwargs.values())
        ):  # no mask, no dropout, no scale
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args)[0]
        return func(*args, **kwargs)
