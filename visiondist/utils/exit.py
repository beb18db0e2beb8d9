"""Ending a process whose work is done without the interpreter's teardown.

A process that has imported torch spends 0.5-1 s after its last line freeing every module and object
one by one (measured on a CPU: a rank 1.1 s, the launcher 0.7 s), which delays the launcher, the
scheduler and whoever waits on the job, and which with NCCL and CUDA loaded is where processes have
hung at exit. Once a tool or a rank has finished (its checkpoint written, its loggers closed, its
process group destroyed) nothing is left for the teardown to do: these functions run the atexit
handlers, flush the standard streams and leave with `os._exit`. Anything that fails takes the
ordinary way out, with its traceback and exit code.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from typing import Callable


def _flush() -> None:
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _keep_op_registrations() -> None:
    """torch.library's objects deregister their operators from the dispatcher when collected, and at
    exit through weakref finalizers: 0.2-0.3 s of a tool's end with torchvision's and other
    libraries' operators loaded, for a dispatcher that `os._exit` then discards whole. Those
    finalizers (only those) are left out of the exit."""
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        target = finalizer.peek()
        if target is not None and getattr(target[1], "__name__", "") == "_del_library":
            finalizer.atexit = False


def exit_now(code: int) -> None:
    """End this process with `code`: the atexit handlers run (logging's shutdown among them; not
    torch.library's operator deregistration, `_keep_op_registrations`), the streams are flushed, the
    interpreter's teardown is skipped. For a tool's `__main__` once `main()` has returned."""
    _keep_op_registrations()
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)


def leave_quickly_when_done() -> Callable[[], None]:
    """For a rank started by multiprocessing: returns `done`, to call once the rank's work has
    returned. Registered first, the handler runs after every atexit handler registered later; the
    process then leaves with exit code 0 without the teardown, once the launcher has read its result
    (multiprocessing's exit path runs the handlers). A rank that raised never calls `done` and exits
    as usual."""
    state = {"done": False}

    def leave() -> None:
        if state["done"]:
            _flush()
            os._exit(0)

    atexit.register(leave)
    return lambda: state.__setitem__("done", True)
