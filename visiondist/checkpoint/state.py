"""What a checkpoint holds, in canonical form: the model's and optimizer's tensors under their
single-device names (a tensor-parallel shard as a DTensor over the TP mesh, so DCP stores its slice
and any layout reads back what it needs), the optimizer's hyperparameters, and each rank's RNG
states as JSON (`rng_rank<R>.json`)."""

from __future__ import annotations

import base64
import random
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from visiondist.parallel.tensor import SHARD_DIM, persistent_buffers


def _tp_mesh(layout):
    return layout.mesh["tp"] if layout is not None and layout.tp > 1 else None


def _canonical(tensor: torch.Tensor, like: torch.Tensor, mesh) -> torch.Tensor:
    """`tensor` (this rank's part of something shaped like parameter `like`) as DCP should see it: a
    DTensor sharded over TP when `like` is a TP shard, the tensor itself otherwise."""
    dim = getattr(like, SHARD_DIM, None)
    if dim is None or mesh is None or tensor.shape != like.shape:
        return tensor
    return DTensor.from_local(tensor, mesh, [Shard(dim)], run_check=False)


def model_state(model: nn.Module, layout=None) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers under canonical names; TP shards as DTensors (views of the
    live tensors, so loading into this dict loads into the model)."""
    mesh = _tp_mesh(layout)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        state[name] = _canonical(param.detach(), param, mesh)
    for name, buffer in persistent_buffers(model):
        if name not in state:
            state[name] = buffer.detach()
    return state


def optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, layout=None
) -> dict[str, torch.Tensor]:
    """Per-parameter optimizer state keyed `<param name>/<state key>`, sharded like its
    parameter."""
    mesh = _tp_mesh(layout)
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"optimizer state {name}/{key} is a {type(value).__name__}, not a tensor"
                )
            state[f"{name}/{key}"] = _canonical(value, param, mesh)
    return state


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state tensors (so a checkpoint has somewhere to load
    into) without changing any parameter: one step at lr 0 from zero gradients, then the gradients
    are cleared again."""
    if optimizer.state:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


def restore_hyperparameters(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint has {len(saved)} optimizer parameter groups, this optimizer "
            f"{len(optimizer.param_groups)}: resume with the optimizer it was saved with"
        )
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value


# -- RNG states as JSON ----------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    # numpy's stubs type both forms; without legacy=False it is always the tuple
    kind, keys, pos, has_gauss, cached = cast(
        tuple[str, np.ndarray, int, int, float], np.random.get_state()
    )
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(
        torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8)
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8)
        )


# -- save / load -----------------------------------------------------------------------------------


def ema_state(ema, layout=None) -> dict[str, torch.Tensor]:
    """A `ModelEma`'s averages under their parameters' canonical names, sharded like them."""
    mesh = _tp_mesh(layout)
    return {name: _canonical(shadow, param, mesh) for name, shadow, param in ema.named_shadows()}
