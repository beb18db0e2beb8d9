"""A user's callbacks on their way to the ranks: checked and serialised before any rank starts
(`pack`), run on every rank by the training entry `TrainWithCallbacks`, and handed back as each
rank ended the run.

Callbacks travel by value (cloudpickle): a class defined in a notebook or a script's `__main__`
reaches ranks that are spawned (a GPU), forked from a fork server or started by torchrun alike,
which could not import it. One that cannot be serialised (it holds an open file, a lock, a
socket) is refused here, naming it and why. cloudpickle leaves a by-value function's file out
(`<dynamic-code>`); each function's file travels beside it and is put back on the ranks, so that a
callback's failure names its file and line."""

from __future__ import annotations

import logging
import types
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import cloudpickle

from visiondist.config import ConfigError
from visiondist.engine.hooks.callbacks import EVENTS
from visiondist.engine.run import RANK_IMPORTS as TRAIN_IMPORTS

log = logging.getLogger(__name__)

# what the ranks import once started (visiondist.launch.spawn preloads them)
RANK_IMPORTS = ("visiondist.engine.run", *TRAIN_IMPORTS)
# the key of a rank's summary that carries its callbacks back (taken off before anyone sees it)
RETURNED = "_callbacks"


def _name(callback: Any, i: int) -> str:
    kind = callback.__name__ if isinstance(callback, type) else type(callback).__name__
    return f"callbacks[{i}] ({kind})"


def pack(callbacks: Sequence[Any]) -> Optional[bytes]:
    """The callbacks serialised for the ranks; ConfigError naming one that has none of the events,
    is a class rather than an object, or cannot be serialised.

    Args:
        callbacks: objects with any of `on_train_start`, `on_step_end`, `on_eval_end`,
            `on_train_end` (each called with a `CallbackState`).

    Returns:
        The bytes every rank loads, or None for no callbacks.
    """
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Sequence):
        callbacks = [callbacks]
    events = ", ".join(EVENTS)
    for i, callback in enumerate(callbacks):
        if isinstance(callback, type):
            raise ConfigError(
                f"{_name(callback, i)} is a class: give an object of it, "
                f"callbacks=[{callback.__name__}()]"
            )
        if not any(callable(getattr(callback, event, None)) for event in EVENTS):
            raise ConfigError(
                f"{_name(callback, i)} has none of {events}: a callback is an object with any of "
                "them, each taking the run's state"
            )
        try:
            cloudpickle.dumps(callback)
        except Exception as exc:  # pickling raises what the object's parts raise
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(
                f"{_name(callback, i)} cannot reach the ranks ({reason}): every rank gets a copy "
                "of it, so what it holds must be picklable; open files, locks and sockets in "
                "on_train_start instead"
            ) from None
    if not callbacks:
        return None
    files = [
        {name: fn.__code__.co_filename for name, fn in _functions(callback).items()}
        for callback in callbacks
    ]
    return cloudpickle.dumps((list(callbacks), files))


def _functions(callback: Any) -> dict[str, types.FunctionType]:
    """A callback's Python functions by name: its classes' methods (static and class methods' too)
    and the functions it holds."""
    found = {}
    # a class by its place in the MRO (a copy by value may not keep its __qualname__)
    owners: list[tuple[str, Mapping[str, Any]]] = [
        (str(i), vars(cls)) for i, cls in enumerate(type(callback).__mro__[:-1])
    ]
    owners.append(("self", getattr(callback, "__dict__", {})))
    for owner, members in owners:
        for name, value in members.items():
            fn = getattr(value, "__func__", value)
            if isinstance(fn, types.FunctionType):
                found[f"{owner}.{name}"] = fn
    return found


def _refiled(code: types.CodeType, file: str) -> types.CodeType:
    """`code` (and the code it defines: nested functions, comprehensions) with its file."""
    consts = tuple(
        _refiled(c, file) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_filename=file, co_consts=consts)


def _unpacked(packed: bytes) -> list:
    """`pack`'s callbacks, each by-value function given back its file."""
    callbacks, files = cloudpickle.loads(packed)
    for callback, named in zip(callbacks, files):
        for name, fn in _functions(callback).items():
            file = named.get(name)
            if file and fn.__code__.co_filename != file:
                fn.__code__ = _refiled(fn.__code__, file)
    return callbacks


class TrainWithCallbacks:
    """The training entry of every rank (`visiondist.engine.run.train`) with the user's callbacks,
    which come back with the rank's summary (as each rank ended the run)."""

    __name__ = "train"

    def __init__(self, packed: bytes):
        self.packed = packed

    def __call__(self, cfg: Any, layout: Any, run_dir: Path) -> dict[str, Any]:
        # a rank's entry: the trainer and its parts, imported by the rank (1 s)
        from visiondist.engine.run import train  # noqa: PLC0415 (rank-side)

        callbacks = _unpacked(self.packed)
        summary = train(cfg, layout, run_dir, callbacks)
        try:
            back = cloudpickle.dumps(callbacks)
        except Exception as exc:  # what a callback took on during the run
            log.warning("the callbacks could not be handed back from this rank: %s", exc)
            return summary
        return {**summary, RETURNED: back}


def unpack(results: dict[int, Any]) -> dict[int, list]:
    """Each rank's callbacks as it ended the run, by rank (taken off the ranks' summaries)."""
    back = {}
    for rank, result in sorted(results.items()):
        if isinstance(result, dict) and RETURNED in result:
            back[rank] = cloudpickle.loads(result.pop(RETURNED))
    return back
