"""Reading torch.distributed.checkpoint (DCP) metadata safely: DCP pickles its `.metadata`, so a
plain unpickler would run whatever a crafted checkpoint names. Used by checkpoint loading and by
`model.weights=<checkpoint dir>`. Also what makes a run's checkpoint complete (`is_complete`,
`list_checkpoints`), which the trainer and the checks before launch both ask."""

from __future__ import annotations

import functools
import pickle
import re
from pathlib import Path
from typing import Any, Optional

_SAFE_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch dtypes / sizes / layouts / memory formats and plain
    containers; anything else (a function, a class that runs code when rebuilt) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        # torch (2 s) and DCP (0.8 s more, with DTensor) are imported where they are used: the
        # torch-free tools (`tools/eval.py --help`) read this module
        import torch  # noqa: PLC0415 (torch: 2 s, torch-free tools read this module)

        if module in _SAFE_MODULES or (module, name) in _SAFE_GLOBALS:
            return metadata_class(super().find_class(module, name))
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refused to load {module}.{name} from checkpoint metadata: "
            "it is not part of a DCP checkpoint"
        )


def metadata_class(cls: type) -> type:
    """The class to rebuild DCP metadata's `cls` with: `cls` itself, or for a `TensorProperties`
    without a `strides` field (torch 2.11-2.14) one that also takes the state torch 2.15 pickles.
    2.15 records each tensor's strides as a sixth field, which the older releases' class cannot
    unpickle ("too many values to unpack"); the subclass drops them, since DCP reads a tensor's
    bytes by its chunk's offsets and sizes, never by its strides. So a run trained under one
    supported torch resumes, evaluates and exports under any other."""
    if cls.__name__ != "TensorProperties" or "strides" in getattr(
        cls, "__dataclass_fields__", {"strides": None}
    ):
        return cls
    return _properties_without_strides(cls)


@functools.cache
def _properties_without_strides(cls: type) -> type:
    fields = len(cls().__getstate__())

    class TensorProperties(cls):
        def __setstate__(self, state: tuple) -> None:
            # what follows (the strides) this torch has no use for
            super().__setstate__(tuple(state)[:fields])

    TensorProperties.__module__ = cls.__module__
    return TensorProperties


@functools.cache
def _safe_reader() -> type:
    """DCP's `FileSystemReader` reading `.metadata` through `_MetadataUnpickler`; made on first use,
    since torch.distributed.checkpoint brings DTensor (about 0.8 s), which listing a run's
    checkpoints needs none of."""
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415 (DCP: 0.8 s)

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")
            path = self._get_metadata_path(rank)
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import (  # noqa: PLC0415 (DCP: 0.8 s)
                    StorageMeta,
                )

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


def __getattr__(name: str) -> Any:
    if name == "SafeFileSystemReader":
        return _safe_reader()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def read_metadata(path: Path):
    return _safe_reader()(str(path)).read_metadata()


CHECKPOINTS = "checkpoints"  # <run>/checkpoints/step_<N>/
STATE_FILE = "trainer_state.json"
METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def is_complete(path: Path) -> bool:
    """A checkpoint directory whose DCP metadata and trainer state are both written."""
    return (path / METADATA).is_file() and (path / STATE_FILE).is_file()


def step_of(path: Path) -> Optional[int]:
    """N for a path named as a run's checkpoint, <run>/checkpoints/step_<N>; else None."""
    match = _STEP_DIR.match(Path(path).name)
    return int(match.group(1)) if match and Path(path).parent.name == CHECKPOINTS else None


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = step_of(entry)
        if step is not None and entry.is_dir() and is_complete(entry):
            found.append((step, entry))
    return sorted(found)
