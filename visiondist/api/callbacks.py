"""A user's callbacks on their way to the ranks: checked and serialised before any rank starts
(`pack`), run on every rank by the training entry `TrainWithCallbacks`, and handed back as each
rank ended the run.

Callbacks travel by value (cloudpickle): a class defined in a notebook or a script's `__main__`
reaches ranks that are spawned (a GPU), forked from a fork server or started by torchrun alike,
which could not import it. One that cannot be serialised (it holds an open file, a lock, a
socket) is refused here, naming it and why."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Sequence

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
    return cloudpickle.dumps(list(callbacks)) if callbacks else None


class TrainWithCallbacks:
    """The training entry of every rank (`visiondist.engine.run.train`) with the user's callbacks,
    which come back with the rank's summary (as each rank ended the run)."""

    __name__ = "train"

    def __init__(self, packed: bytes):
        self.packed = packed

    def __call__(self, cfg: Any, layout: Any, run_dir: Path) -> dict[str, Any]:
        # a rank's entry: the trainer and its parts, imported by the rank (1 s)
        from visiondist.engine.run import train  # noqa: PLC0415 (rank-side)

        callbacks = cloudpickle.loads(self.packed)
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
    for rank, result in results.items():
        if isinstance(result, dict) and RETURNED in result:
            back[rank] = cloudpickle.loads(result.pop(RETURNED))
    return back
