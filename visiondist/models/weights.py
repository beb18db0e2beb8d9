"""Loading local weights: never a download, never unpickling arbitrary objects."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn


def load_local_weights(model: nn.Module, path: str, convert: Optional[Callable[[dict], dict]] = None) -> None:
    """Load a local state dict (.safetensors, or a torch file read with weights_only=True) into `model`, strictly;
    `convert` maps foreign key layouts (e.g. timm's) onto the model's first."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"model.weights={path}: no such file")
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(file))
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
        state = state.get("model", state) if isinstance(state, dict) else state
    model.load_state_dict(convert(state) if convert else state, strict=True)
