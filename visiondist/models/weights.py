"""Loading local weights: never a download, never unpickling arbitrary objects."""

from __future__ import annotations

import logging
import math
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from visiondist.utils.dcp import read_metadata

log = logging.getLogger(__name__)


def read_state(path: str, key: str = "model.weights") -> dict[str, torch.Tensor]:
    """A local state dict: .safetensors, or a torch file read with weights_only=True."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"{key}={path}: no such file")
    if file.suffix == ".safetensors":
        return load_file(str(file))
    return _state_dict(_torch_load(file, key), file, key)


def not_weights(file: Path) -> Optional[str]:
    """What a file that runs a model but holds no weights to read is (an export's ONNX graph,
    TorchScript archive or torch.export program), or None."""
    if file.suffix == ".onnx":
        return "an ONNX graph (tools/export.py format=onnx)"
    if zipfile.is_zipfile(file):
        with zipfile.ZipFile(file) as archive:
            names = archive.namelist()
        if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
            return "a TorchScript archive (tools/export.py format=torchscript)"
        if any(n.endswith("/archive_format") for n in names):
            return "a torch.export program (tools/export.py format=pt2)"
    return None


def _torch_load(file: Path, key: str, mmap: bool = False) -> object:
    """torch.load with weights_only=True (`mmap`: memory-mapped where the file's format allows),
    after refusing the files it cannot read as weights, naming them."""
    foreign = not_weights(file)
    if foreign is not None:
        raise ValueError(
            f"{key}={file} is {foreign}, which runs the model but is not read as weights: give a "
            "weights file, e.g. <run>/model.safetensors or tools/export.py's model.safetensors"
        )
    try:
        if mmap:
            try:
                return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a file in torch's legacy format cannot be memory-mapped
                pass
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(
            f"{key}={file} is a pickle holding more than tensors, which is never unpickled here "
            "(it could run code): give a .safetensors file or a torch file of tensors "
            "(torch.save of a state_dict)"
        ) from None


# the entries training scripts keep a model's state dict under (timm's and Lightning's
# `state_dict`, DeiT's and most scripts' `model`, ...), the model's own before its EMA's
WRAPPERS = ("state_dict", "model", "module", "net", "state_dict_ema", "model_ema")
# what a wrapped model's keys begin with: DDP's, torch.compile's
PREFIXES = ("module.", "_orig_mod.")


def _state_dict(loaded: object, file: Path, key: str, say: bool = False) -> dict[str, Any]:
    """The state dict a torch file holds: the file's dict, or the first entry of `WRAPPERS` it holds
    (a training checkpoint's), with a prefix every key carries (`PREFIXES`) taken off; `say`: log
    which entry was read where there was a choice."""
    state = loaded
    if isinstance(loaded, dict):
        entries = [w for w in WRAPPERS if isinstance(loaded.get(w), dict)]
        if entries:
            state = loaded[entries[0]]
            if say:
                others = f" (it also holds {', '.join(entries[1:])})" if entries[1:] else ""
                log.info("%s: read %s's `%s`%s", key, file.name, entries[0], others)
    if not isinstance(state, dict):
        raise ValueError(f"{key}={file} holds a {type(state).__name__}, not a state dict")
    prefix = wrapper_prefix(list(state))
    return {k[len(prefix) :]: v for k, v in state.items()} if prefix else state


def wrapper_prefix(keys: list) -> str:
    """The prefix every key of a state dict saved from a wrapped model carries (DDP's `module.`,
    torch.compile's `_orig_mod.`, or both), else ""."""
    prefix = ""
    for p in PREFIXES * 2:
        if keys and all(isinstance(k, str) and k.startswith(prefix + p) for k in keys):
            prefix += p
    return prefix


def weight_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of weights without reading the tensors: a safetensors header, a DCP
    checkpoint's metadata (its model tensors, under their canonical names), or a torch file
    memory-mapped."""
    file = Path(path).expanduser()
    if file.is_dir():
        stored = read_metadata(file).state_dict_metadata
        return {
            k[len("model.") :]: tuple(v.size)
            for k, v in stored.items()
            if k.startswith("model.") and hasattr(v, "size")
        }
    if file.suffix == ".safetensors":
        with safe_open(str(file), framework="pt") as f:
            prefix = wrapper_prefix(list(f.keys()))
            return {k[len(prefix) :]: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    state = _state_dict(_torch_load(file, "model.weights", mmap=True), file, "model.weights")
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def save_weights(
    state: dict[str, torch.Tensor], path: str | os.PathLike, metadata: Optional[dict] = None
) -> None:
    """`safetensors.torch.save_file`, then the file mode every other output gets (0o666 less the
    umask; safetensors itself writes 0o600)."""
    save_file(state, str(path), metadata=metadata)
    output_mode(path)


def output_mode(path: str | os.PathLike) -> None:
    """Give a written file the mode every other output gets: 0o666 less the umask (safetensors
    writes 0o600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def load_local_weights(
    model: nn.Module, path: str, convert: Optional[Callable[[dict], dict]] = None
) -> None:
    """Load a local state dict into `model`, strictly; `convert` maps foreign key layouts (e.g.
    timm's) onto the model's first."""
    state = read_state(path)
    state = convert(state) if convert else state
    match_frozen_batchnorms(model, state.keys())
    model.load_state_dict(state, strict=True)


def match_frozen_batchnorms(model: nn.Module, stored: Iterable[str]) -> int:
    """Weights saved from a model whose BatchNorms were frozen (torchvision's FrozenBatchNorm2d,
    which a detector started from pretrained weights has: no `num_batches_tracked`) load into a
    model built with trainable ones by freezing those BatchNorms first, as the saved model had them.
    Returns how many were frozen."""
    stored = set(stored)
    return freeze_batchnorms(
        model,
        lambda name: (
            f"{name}.running_mean" in stored and f"{name}.num_batches_tracked" not in stored
        ),
    )


def freeze_batchnorms(model: nn.Module, which: Optional[Callable[[str], bool]] = None) -> int:
    """Replace the BatchNorm2d modules of `model` (those whose name `which` accepts; default all) by
    torchvision's FrozenBatchNorm2d with the same eps, on the same device; their statistics and
    affine values are loaded next. Returns how many were replaced."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.BatchNorm2d) and (which is None or which(name))
    ]
    if not targets:
        return 0  # a ViT's processes need not import torchvision for this
    # torchvision (with torch._dynamo: 0.7-0.85 s) for detectors only
    from torchvision.ops.misc import FrozenBatchNorm2d  # noqa: PLC0415 (torchvision: see above)

    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        frozen = FrozenBatchNorm2d(module.num_features, eps=module.eps).to(module.weight.device)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, frozen)
    return len(targets)


class LazyState(Mapping):
    """A local weights file's tensors, each read when asked for: a safetensors file one tensor per
    read, a torch file memory-mapped. A rank that keeps a shard of each tensor thus never holds the
    whole file."""

    def __init__(self, path: str, key: str = "model.weights"):
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"{key}={path}: no such file")
        if file.suffix == ".safetensors":
            handle = safe_open(str(file), framework="pt")
            keys = list(handle.keys())
            prefix = wrapper_prefix(keys)
            self._keys = [k[len(prefix) :] for k in keys]
            self._read = lambda k: handle.get_tensor(prefix + k)
        else:
            state = _state_dict(_torch_load(file, key, mmap=True), file, key, say=True)
            self._keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
            self._read = state.__getitem__

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._read(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class Overlay(Mapping):
    """`base` with some tensors replaced (a resampled position embedding) or left out (a classifier
    of another size), read lazily like `base`."""

    def __init__(self, base: Mapping[str, torch.Tensor]):
        self.base = base
        self.replaced: dict[str, torch.Tensor] = {}
        self.removed: set[str] = set()

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.removed:
            raise KeyError(key)
        return self.replaced[key] if key in self.replaced else self.base[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.removed.discard(key)
        self.replaced[key] = value

    def __delitem__(self, key: str) -> None:
        self.removed.add(key)

    def __iter__(self) -> Iterator[str]:
        yield from (k for k in self.base if k not in self.removed)
        yield from (k for k in self.replaced if k not in self.base)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def check_fits(
    state: Mapping,
    own: Mapping[str, torch.Tensor],
    key: str,
    path: str,
    model: str,
    skipped: tuple[str, ...] = (),
) -> None:
    """Every tensor of the model in `state` and nothing else (`skipped` excepted), or an error
    naming both sides."""
    missing = [k for k in own if k not in state and k not in skipped]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise ValueError(
            f"{key}={path} does not fit {model}: missing {', '.join(missing[:5]) or 'nothing'}; "
            f"unexpected {', '.join(unexpected[:5]) or 'nothing'}"
        )


def plan_init_from(
    weights: Mapping[str, torch.Tensor],
    own: Mapping[str, torch.Tensor],
    path: str,
    model: str,
    new_head: tuple[str, ...] = ("head.weight", "head.bias"),
) -> tuple[Overlay, list[str]]:
    """Fine-tuning from local weights: every tensor must match `own` (the model's, by shape; meta
    tensors do), except the classifier (`new_head`), which keeps its fresh initialisation when the
    class count differs or the file has none (a backbone saved without its head), and a ViT's
    position embedding, resampled to the model's image size. Returns the weights to load and the
    names left at their initialisation."""
    state = Overlay(weights)
    resample_pos_embed(state, own)
    absent = [k for k in new_head if k in own and k not in state]
    resized = [k for k in new_head if k in own and k in state and state[k].shape != own[k].shape]
    for key in resized:
        del state[key]
    skipped = [k for k in new_head if k in absent or k in resized]
    check_fits(state, own, "model.init_from", path, model, tuple(skipped))
    loaded = sum(1 for k in state if k in own)
    log.info("model.init_from: %d of the model's %d tensors from %s", loaded, len(own), path)
    if skipped:
        why = (
            "the file has another number of classes"
            if resized
            else "the file has no classification head"
        )
        log.info("model.init_from: %s re-initialised (%s)", ", ".join(skipped), why)
    return state, skipped


def init_from(
    model: nn.Module,
    path: str,
    convert: Optional[Callable[[Mapping], Mapping]] = None,
    new_head: tuple[str, ...] = ("head.weight", "head.bias"),
) -> list[str]:
    """`plan_init_from` applied to a built model: its weights loaded, the names left at their
    initialisation returned."""
    weights = LazyState(path, "model.init_from")
    state, skipped = plan_init_from(
        convert(weights) if convert else weights,
        model.state_dict(),
        path,
        type(model).__name__,
        new_head,
    )
    model.load_state_dict({k: state[k] for k in state}, strict=False)
    return skipped


def resample_pos_embed(
    state: Overlay, own: Mapping[str, torch.Tensor], key: str = "pos_embed", prefix_tokens: int = 1
) -> None:
    """ViT weights made for another image size: their position embedding resampled to the model's
    grid the way timm does (bicubic, the class token kept), in `state`."""
    old, new = state.get(key), own.get(key)
    if old is None or new is None or old.shape == new.shape or old.shape[-1] != new.shape[-1]:
        return
    sizes = [math.isqrt(t.shape[1] - prefix_tokens) for t in (old, new)]
    if any(s * s != t.shape[1] - prefix_tokens for s, t in zip(sizes, (old, new))):
        return  # not a square grid: the load reports the mismatch
    # timm brings torchvision, DTensor and torch._dynamo (2-3 s): only for weights of another size
    from timm.layers import resample_abs_pos_embed  # noqa: PLC0415 (timm: 2-3 s, see above)

    state[key] = resample_abs_pos_embed(
        old, new_size=[sizes[1]] * 2, old_size=[sizes[0]] * 2, num_prefix_tokens=prefix_tokens
    )
    log.info(
        "model.init_from: %s resampled from %d x %d to %d x %d patches",
        key,
        *[sizes[0]] * 2,
        *[sizes[1]] * 2,
    )
