"""The PyTorch releases visiondist runs on (2.11 through 2.15) differ in a few APIs; this module is
the one place that knows, by feature detection (never a version string), and the rest of the code
calls it.

- `set_pg_timeout`: `torch.distributed.set_timeout` (newer) or `distributed_c10d._set_pg_timeout`
  (2.11).
- `all_gather_into` / `reduce_scatter_into`: `all_gather_single` / `reduce_scatter_single` (newer)
  or `all_gather_into_tensor` / `reduce_scatter_tensor` (2.11); the same argument order.
- `split_mesh`: a 1-D `DeviceMesh` unflattened into named dims (`DeviceMesh._unflatten`, private in
  every supported release: checked by name).
- `PIPELINE_STAGE_OVERRIDES`: the private `PipelineStage` methods the timed stage wraps, with the
  parameters it passes; `check_pipeline_stage` (and a test) fails loudly when a release changes
  them.
- `quiet_pytree`: silences the warnings newer torch logs when a library (torchao, imported directly
  or by transformers, at import or later) registers an Enum with pytree (2.14+ handles Enums
  natively), and the invalid-escape SyntaxWarning (a DeprecationWarning before Python 3.12) that
  compiling torchao's own sources prints where no bytecode is cached: nothing a user can act on.
  Only those, only from torchao's files.
- `flight_recorder_env`: the name of the flight recorder's buffer-size variable:
  `TORCH_FR_BUFFER_SIZE` where this torch reads it (it warns that the old
  `TORCH_NCCL_TRACE_BUFFER_SIZE` is deprecated), else the old one.
- `agent_signals`: the elastic agent leaves SIGTERM / SIGINT to the launching process
  (`visiondist.launch.stop`): `LaunchConfig.signals_to_handle` where it exists, which sets the
  environment variable every supported release's process context reads,
  `TORCHELASTIC_SIGNALS_TO_HANDLE`.
- `announced_restarts`: the elastic agent restarts every rank after one fails without a word (its
  log is quiet: the launcher speaks); its private `_monitor_workers` / `_restart_workers` (in every
  supported release) are wrapped while the ranks run so that each restart is one line naming the
  rank that ended.
- `quick_rendezvous_names`: the elastic rendezvous names every event it records by its caller, found
  with `inspect.stack()` twice an event, even where nothing records events (the default): each call
  reads the source of every frame and looks its module up among all those loaded. With torchvision
  and the tools' libraries imported that is 0.1-0.3 s an event, over a second of every launch of
  several ranks; the frame itself gives the same name.

One difference is met where it is read instead: torch 2.15's DCP records each tensor's strides in a
checkpoint's metadata, which 2.11-2.14 cannot unpickle; `visiondist.utils.dcp.metadata_class` takes
them (`visiondist.utils` sits in the lowest layer beside this module, and may not import it).
"""

from __future__ import annotations

import inspect
import logging
import mmap
import os
import signal
import sys
import warnings
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.elastic.multiprocessing import api as elastic_api
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

SUPPORTED = "torch 2.11 through 2.15"


def quiet_pytree() -> None:
    """torch's pytree logger at ERROR in this process, from now on, and torchao's invalid escape
    sequences unwarned (see the module docstring); call it before importing torchao or what imports
    it."""
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    # a compile-time warning's module is its file's path
    for category in (SyntaxWarning, DeprecationWarning):
        warnings.filterwarnings(
            "ignore",
            message="invalid escape sequence",
            category=category,
            module=r".*[/\\]torchao[/\\]",
        )


def flight_recorder_env() -> str:
    """`TORCH_FR_BUFFER_SIZE` where this torch reads it, else `TORCH_NCCL_TRACE_BUFFER_SIZE`
    (torch's C++ reads them, so the check is on the sources torch ships: its headers, else its
    library)."""
    new = "TORCH_FR_BUFFER_SIZE"
    root = Path(torch.__file__).parent
    header = root / "include" / "torch" / "csrc" / "distributed" / "c10d" / "FlightRecorder.hpp"
    if header.is_file():
        return new if new in header.read_text(errors="replace") else "TORCH_NCCL_TRACE_BUFFER_SIZE"
    for library in sorted((root / "lib").glob("libtorch_c*.so")):  # libtorch_cpu / libtorch_cuda
        with library.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data.find(new.encode()) >= 0:
                return new
    return "TORCH_NCCL_TRACE_BUFFER_SIZE"


def set_pg_timeout(timeout: timedelta, group: Optional[Any] = None) -> None:
    """Later collectives on `group` (default: the world) fail after `timeout`."""
    if hasattr(dist, "set_timeout"):
        dist.set_timeout(timeout, group) if group is not None else dist.set_timeout(timeout)
    else:
        distributed_c10d._set_pg_timeout(timeout, group)


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """Every rank's `inp` concatenated along dim 0 into `out`."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """The sum over ranks of `inp`, this rank's dim-0 chunk of it into `out`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, inp, group=group)


def split_mesh(mesh, sizes: tuple[int, ...], names: tuple[str, ...]):
    """`mesh` (1-D) as a mesh of `sizes` with dims `names`, over the same ranks in the same
    order."""
    unflatten = getattr(mesh, "_unflatten", None)
    if unflatten is None:
        raise RuntimeError(
            f"torch {torch.__version__}: DeviceMesh._unflatten is gone; HSDP (parallel.shard_size) "
            f"needs it ({SUPPORTED} have it): use parallel.shard_size=0"
        )
    return unflatten(0, sizes, names)


# PipelineStage methods the timed stage overrides -> the parameters it passes on (private API:
# checked)
PIPELINE_STAGE_OVERRIDES = {
    "get_fwd_send_ops": ("fwd_chunk_id",),
    "get_bwd_send_ops": ("bwd_chunk_id",),
    "forward_one_chunk": ("fwd_chunk_id",),
    "backward_one_chunk": ("bwd_chunk_id", "loss", "full_backward", "last_backward"),
    "backward_weight_one_chunk": ("bwd_chunk_id", "last_backward"),
}


def check_pipeline_stage() -> None:
    """Raise if this torch's `PipelineStage` lacks a method the timed stage overrides or one of its
    parameters."""
    # pipelining brings DTensor and dynamo (1.6 s), and the launching process imports this module
    from torch.distributed.pipelining import PipelineStage  # noqa: PLC0415 (pipelining: 1.6 s)

    for name, params in PIPELINE_STAGE_OVERRIDES.items():
        method = getattr(PipelineStage, name, None)
        if method is None:
            raise RuntimeError(
                f"torch {torch.__version__}: PipelineStage.{name} is gone; visiondist supports "
                f"{SUPPORTED}"
            )
        missing = set(params) - set(inspect.signature(method).parameters)
        if missing:
            raise RuntimeError(
                f"torch {torch.__version__}: PipelineStage.{name} lacks {sorted(missing)}; "
                f"visiondist supports {SUPPORTED}"
            )


# what torch's elastic agent still turns into "kill the ranks" itself
AGENT_SIGNALS = "SIGHUP,SIGQUIT"


def agent_signals(config_fields: set[str]) -> dict[str, str]:
    """LaunchConfig's keyword for the agent's signals, or {} after setting the environment variable
    it would set."""
    if "signals_to_handle" in config_fields:
        return {"signals_to_handle": AGENT_SIGNALS}
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = AGENT_SIGNALS
    return {}


def agent_reads_signal_list() -> bool:
    """Whether this torch's elastic process context takes its signals from
    TORCHELASTIC_SIGNALS_TO_HANDLE."""
    return "TORCHELASTIC_SIGNALS_TO_HANDLE" in inspect.getsource(elastic_api)


def quick_rendezvous_names() -> bool:
    """The rendezvous' `get_method_name(depth)` from the frame `depth` levels up (`sys._getframe`),
    the name `inspect.stack()[depth].function` gives, without reading any source (module docstring).
    False where this torch has no such function (nothing to do)."""
    original = getattr(dynamic_rendezvous, "get_method_name", None)
    if original is None or getattr(original, "quick", False):
        return original is not None

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # fewer frames than that
            return "no_method_name"

    get_method_name.quick = True  # type: ignore[attr-defined]
    get_method_name.original = original  # type: ignore[attr-defined]
    dynamic_rendezvous.get_method_name = get_method_name
    return True


@contextmanager
def announced_restarts(say: Callable[[str], None]) -> Iterator[None]:
    """While the agent runs the ranks: before each restart of them, `say` one line naming the rank
    that ended and why, and the restart's number. Nothing where this torch's agent has not the
    two methods (module docstring)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import (  # noqa: PLC0415
        LocalElasticAgent,
    )

    monitor = getattr(LocalElasticAgent, "_monitor_workers", None)
    restart = getattr(LocalElasticAgent, "_restart_workers", None)
    if monitor is None or restart is None:
        yield
        return

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        self._visiondist_failures = dict(getattr(result, "failures", {}) or {})
        return result

    def _restart_workers(self, worker_group):
        failures = getattr(self, "_visiondist_failures", {})
        total = int(worker_group.spec.max_restarts)
        number = total - int(getattr(self, "_remaining_restarts", 0))
        say(f"{_ended(failures)}: every rank restarts from the newest checkpoint (restart "
            f"{number} of trainer.max_restarts={total})")  # fmt: skip
        return restart(self, worker_group)

    LocalElasticAgent._monitor_workers = _monitor_workers  # type: ignore[method-assign]
    LocalElasticAgent._restart_workers = _restart_workers  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
        LocalElasticAgent._restart_workers = restart  # type: ignore[method-assign]


def _ended(failures: dict[int, Any]) -> str:
    """ "rank 1 ended (killed by SIGKILL)": the rank killed by a signal if one was (its peers then
    fail on its lost connection), else the lowest that failed."""
    if not failures:
        return "a rank ended"
    killed = sorted(r for r, f in failures.items() if getattr(f, "exitcode", 0) < 0)
    rank = killed[0] if killed else min(failures)
    code = int(getattr(failures[rank], "exitcode", 1))
    try:
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    except ValueError:
        why = f"exit code {code}"
    return f"rank {rank} ended ({why})"
