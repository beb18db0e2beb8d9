"""A package's exports imported on first use (PEP 562), so that a process reading one light module
of a package (the launcher planning a run) does not pay for the heavy modules the package's other
names come from."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(
    package: str, where: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], list[str]]:
    """`__getattr__, __all__ = lazy_exports(__name__, {"submodule": ("name", ...)})`: each name is
    imported from its submodule when first asked for, then kept on the package. The package's
    `dir()` lists them from the start (a notebook's completion offers them)."""
    module_of = {name: module for module, names in where.items() for name in names}
    module = sys.modules[package]

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(module_of))

    module.__dir__ = __dir__  # type: ignore[method-assign]

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module_of[name]}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__, sorted(module_of)
