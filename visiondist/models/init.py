"""Deferred initialisation: a model built on the meta device (no memory), laid out over the mesh,
then each rank allocates and fills only the tensors it keeps.

Every parameter's initial value is drawn from a generator of its own, seeded by the model's seed and
the parameter's name; the model's seed is one draw from torch's global generator when the model is
built (so `torch.manual_seed` still decides the weights). A rank can therefore draw exactly the
tensor one process would draw for a name, one tensor at a time, and keep its shard: a
tensor-parallel, pipelined or fully sharded run starts from the weights a single process draws for
the same seed, bit for bit, while no rank ever holds more than its shards plus the largest single
tensor. Draws happen on the CPU whatever the device, so the CPU and a GPU start from the same
weights too.

`InitSource` answers "the full initial value of parameter `name`": the model's init rule, or a local
weights file (`model.weights`, or `model.init_from` with its new head and resampled position
embedding), read one tensor at a time. `materialize` allocates a meta model's tensors on a device
and fills them from a source; `local` (given by the layout) cuts each full tensor down to what this
rank holds.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Callable, Iterator, Mapping, Optional, Protocol

import torch
from torch import nn

log = logging.getLogger(__name__)

# fills a full tensor in place from a generator (what it returns, torch's init functions return the
# tensor, is not read)
Rule = Callable[[torch.Tensor, torch.Generator], object]
# (name, this rank's param, full) -> its part
Local = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


def draw_seed() -> int:
    """The model's seed: one draw from torch's global CPU generator, the same under any default
    device."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def generator_for(seed: int, name: str) -> torch.Generator:
    """A CPU generator of its own for parameter `name` (a stable hash: Python's `hash` differs per
    process)."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


class DrawsItsValues(Protocol):
    """A model that draws its own initial values (the ViT): its seed, a rule per parameter, and
    its parameters by name."""

    init_seed: int

    def init_rules(self) -> dict[str, Rule]: ...

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]: ...


class InitSource:
    """The full initial value of each parameter of a (meta) model, on the CPU: drawn by the model's
    rules, or read from `state` (a mapping read lazily, one tensor per access) for the names it
    holds.

    `shapes` are the full shapes, taken before any layout changes the model; `fresh` the names drawn
    by the rules although `state` is given (a new classifier head)."""

    def __init__(
        self,
        model: DrawsItsValues,
        state: Optional[Mapping[str, torch.Tensor]] = None,
        fresh: tuple[str, ...] = (),
    ):
        self.seed = int(model.init_seed)
        self.rules: dict[str, Rule] = model.init_rules()
        self.shapes = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
        missing = set(self.shapes) - set(self.rules)
        if missing:
            raise ValueError(
                f"{type(model).__name__} has no init rule for {', '.join(sorted(missing)[:5])}"
            )
        self.state, self.fresh = state, set(fresh)

    def __call__(self, name: str) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        if self.state is not None and name not in self.fresh:
            value = self.state[name]
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"{name}: the weights hold {tuple(value.shape)}, the model {shape}"
                )
            return value.to(dtype)
        full = torch.empty(shape, dtype=dtype, device="cpu")
        with torch.no_grad():
            self.rules[name](full, generator_for(self.seed, name))
        return full


def reset_buffers(model: nn.Module) -> None:
    """Recompute the buffers of modules that derive them from their settings (`reset_buffers()`);
    any other buffer of a materialised meta model would hold garbage, so it is an error."""
    for module_name, module in model.named_modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
        elif any(True for _ in module.buffers(recurse=False)):
            raise ValueError(
                f"{module_name or type(model).__name__} has buffers but no reset_buffers(): it "
                "cannot be built on the meta device"
            )


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device | str,
    source: Optional[Callable[[str], torch.Tensor]],
    local: Optional[Local] = None,
) -> nn.Module:
    """Allocate the meta `model`'s tensors on `device` and fill each parameter from `source(name)`
    (its full value), cut by `local` to what this rank holds (default: all of it). `source=None`
    leaves the parameters uninitialised (a checkpoint is loaded next). Parameter objects are kept
    (their layout tags, the optimizer-to-be's references), only their storage is replaced."""
    # swap_tensors keeps each Parameter object, so one shared by two modules (a pipeline stage and
    # its rank's model) stays shared; it swaps the attributes away too, so they are put back.
    attributes = [(param, dict(param.__dict__)) for param in model.parameters()]
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    for param, attrs in attributes:
        param.__dict__.update(attrs)
    reset_buffers(model)
    if source is None:
        return model
    for name, param in model.named_parameters():
        full = source(name)
        value = local(name, param, full) if local is not None else full
        target = param.to_local() if hasattr(param, "to_local") else param
        if tuple(target.shape) != tuple(value.shape):
            raise RuntimeError(
                f"{name}: this rank holds {tuple(target.shape)} but its share of the initial "
                f"value is {tuple(value.shape)}"
            )
        target.copy_(value)
    return model


def is_meta(model: nn.Module) -> bool:
    """Whether `model` was built on the meta device and still awaits `materialize`."""
    return any(p.is_meta for p in model.parameters())
