"""What the memory model counts, measured on a built module: the storages autograd saves for the
backward (`saved_storages`, `saved_activation_bytes`: the activation estimate's check) and a whole
module's parameter, gradient and optimizer bytes (`module_state`: any model family, e.g. on the
meta device). torch is imported where they run: plan/ stays torch-free to import."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from visiondist.plan.memory import FLOAT, RankMemory, Tensors, optimizer_bytes


@contextmanager
def saved_storages(module) -> Iterator[dict]:
    """Measured: the bytes of the distinct storages autograd saves for the backward of what runs
    inside the block, `module`'s parameters and views of any parameter (e.g. FSDP's gathered
    weights) left out: what the activation estimate models, in `["bytes"]` after the block. Storages
    are told apart by identity, which works for meta and fake tensors too; the graphs must stay
    alive inside the block (a freed storage's identity can be reused)."""
    import torch  # noqa: PLC0415 (torch, 2 s: plan/ is torch-free)
    from torch import nn  # noqa: PLC0415 (torch: plan/ is torch-free)

    params = {p.untyped_storage()._cdata for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        base = tensor._base if tensor._base is not None else tensor
        if not isinstance(base, nn.Parameter) and base.untyped_storage()._cdata not in params:
            storage = tensor.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
        return tensor

    out = {"bytes": 0}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield out
    out["bytes"] = sum(seen.values())


def saved_activation_bytes(module, *inputs) -> int:
    """`saved_storages` of one `module(*inputs)`."""
    with saved_storages(module) as saved:
        module(*inputs)
    return saved["bytes"]


def module_state(module, optimizer: str, momentum: float = 0.9) -> RankMemory:
    """Parameter, gradient and optimizer-state bytes of a whole module (any family: counted from its
    tensors, e.g. on the meta device) under DDP: every parameter, gradients and optimizer state for
    the trainable ones only (frozen layers get neither). Activations are not modelled here (0)."""
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    held = Tensors(sum(p.numel() for p in trainable), len(trainable))
    return RankMemory(
        params=FLOAT * sum(p.numel() for p in params),
        grads=FLOAT * held.elements,
        optimizer=optimizer_bytes(held, optimizer, momentum),
        ema=0,
        activations=0,
    )
