"""What `trainer.compile` did: the first step's time with compilation, the graphs dynamo made, and
the graph breaks and recompile-limit hits (code that runs eager) that a compiled run should not
have, read from dynamo's counters (`compile_counts`; the benchmark's `CompileWatch` reads the
same)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, ContextManager, Iterator

from visiondist.engine.build import run_of
from visiondist.engine.trainer import Hook, Trainer

log = logging.getLogger(__name__)


class CompileHook(Hook):
    """Under `trainer.compile`, how long this process's first step took, compilation included, how
    many graphs dynamo made and where Inductor keeps them for the next run of the same shapes; graph
    breaks and frames past dynamo's recompile limit (code that runs eager) are warned about with
    torch's reasons, after the first step and again at the end of training if more came."""

    def __init__(self) -> None:
        self.breaks = 0

    def step_context(self, trainer: Trainer) -> ContextManager[Any]:
        if not run_of(trainer.layout).compile or trainer.state.step != trainer.state.resumed.step:
            return contextlib.nullcontext()
        return self._timed(trainer)

    @contextlib.contextmanager
    def _timed(self, trainer: Trainer) -> Iterator[None]:
        started = time.perf_counter()
        yield
        if trainer.layout.is_main:
            run = run_of(trainer.layout)
            what = (
                "the whole model" + (", replayed as CUDA graphs" if run.cuda_graphs else "")
                if run.compile_scope == "model"
                else "each transformer block (the blocks share one graph)"
            )
            graphs, _ = compile_counts()
            log.info(
                "compiled %s: the first step took %.1f s, compilation included (%d graph%s; "
                "Inductor's caches in %s make a run of the same shapes start sooner)",
                what,
                time.perf_counter() - started,
                graphs,
                "s" if graphs != 1 else "",
                os.environ.get("TORCHINDUCTOR_CACHE_DIR", "its temporary folder"),
            )
            self._warn_breaks()

    def after_train(self, trainer: Trainer, complete: bool) -> None:
        if run_of(trainer.layout).compile and trainer.layout.is_main:
            self._warn_breaks()

    def _warn_breaks(self) -> None:
        _, reasons = compile_counts()
        total = sum(reasons.values())
        if total > self.breaks:
            log.warning(
                "torch.compile: %d graph break%s or recompile-limit hit%s so far (that code runs "
                "eager): %s",
                total,
                "s" if total != 1 else "",
                "s" if total != 1 else "",
                "; ".join(f"{n}x {reason}" for reason, n in list(reasons.items())[:3]),
            )
            self.breaks = total


def compile_counts() -> tuple[int, dict[str, int]]:
    """(graphs dynamo compiled, {reason: count} of its graph breaks and recompile-limit hits) in
    this process so far."""
    # here: importing dynamo costs a rank 1.2 s, a run without compile none
    from torch._dynamo.utils import counters  # noqa: PLC0415 (dynamo, 1.2 s)

    reasons = {
        str(reason).splitlines()[0][:200]: n for reason, n in counters["graph_break"].items()
    }
    # a frame given up on: past the recompile limit, it runs eager
    for reason, n in counters["unimplemented"].items():
        if "recompile limit" in str(reason).lower():
            reasons["dynamo's recompile limit hit (the frame runs eager from then on)"] = n
    return int(counters["stats"].get("unique_graphs", 0)), reasons
