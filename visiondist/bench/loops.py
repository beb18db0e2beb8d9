"""The loops a benchmark times: visiondist's own optimizer step on fixed batches (`OursRun`), each
configuration's plain loops (`plain_loops`), and `Timed`, one loop as the rounds see it;
`CompileWatch` tells which of them compiled with faults (code that runs eager)."""

from __future__ import annotations

import itertools
from functools import partial
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig

from visiondist.bench.measure import PeakMemory, decoded_batch, synthetic_batch, time_steps
from visiondist.bench.plain_loop import PlainLoop, baseline_roles
from visiondist.engine.components import build_components
from visiondist.engine.hooks.compile import compile_counts
from visiondist.engine.hooks.periodic import reset_traffic
from visiondist.engine.optim import describe_optimizer
from visiondist.engine.precision import set_tf32
from visiondist.engine.state import LoopState
from visiondist.engine.step import OptimizerStep
from visiondist.models.sdpa import current_order, select_attention
from visiondist.parallel import Layout


def apply_switches(
    cfg: DictConfig, device: torch.device, attention: Optional[list[str]] = None
) -> None:
    """The process-wide switches a configuration's steps run under: the attention kernel (in
    `attention`'s order: what `model.sdpa=auto` measured for the trainer; the plain loops get
    torch's own), and TF32 on CUDA."""
    select_attention(cfg.model.sdpa, attention)
    if device.type == "cuda":
        set_tf32(cfg.trainer.tf32)


class OursRun:
    """One configuration's optimizer step as the training loop takes it (its parts built as a rank
    builds them, the `OptimizerStep` part), stepping on fixed synthetic batches. No run dir: nothing
    is written."""

    def __init__(self, name: str, cfg: DictConfig, layout: Layout, family: str):
        self.name, self.cfg, self.layout, self.device = name, cfg, layout, layout.device
        apply_switches(cfg, self.device)
        memory = PeakMemory(self.device)
        self.parts = build_components(cfg, layout)
        self.state = LoopState()
        self.optimizer_step = OptimizerStep(cfg, layout, self.parts, self.state)
        self.attention = current_order()  # model.sdpa=auto on CUDA: the order the build measured
        self.optimizer_name = describe_optimizer(self.parts.optimizer, cfg.optim.impl)
        micro = self.parts.data.train_sampler.micro_batch  # per DP rank and accumulation step
        accum = cfg.trainer.grad_accum
        if (
            family == "classification"
            and cfg.data.get("decode_on", "loader") == "device"
            and layout.reads_images
        ):
            # nvJPEG's time depends on the files: the run's own first batches
            self.batches = self._own_jpegs(accum)
        else:
            self.batches = [
                synthetic_batch(cfg, family, micro, self.device, seed=i) for i in range(accum)
            ]
        # plain loops decode in loaders
        self.plain_batches = [decoded_batch(b, self.device) for b in self.batches]
        # as the trainer's batches
        self.feed = self.parts.task.feed(itertools.cycle(self.batches), self.device)
        pipeline = self.parts.pipeline
        reset_traffic(layout, pipeline)
        # compiling happens here: a graph break or a recompile-limit hit fails the row
        with CompileWatch() as watch:
            time_steps(
                self.step, max(cfg.bench.warmup, 2 if pipeline is not None else 1), self.device
            )
        self.compile_faults = watch.faults
        reset_traffic(layout, pipeline)
        time_steps(self.step, 1, self.device)  # one step's traffic (every step moves the same)
        self.tp_bytes = layout.tp_comm.ring_bytes() if layout.tp_comm is not None else 0.0
        self.pp_bytes = pipeline.p2p.bytes if pipeline is not None else 0
        self.peak_memory_gb, self.peak_reserved_gb = memory.increase_gb(), memory.reserved_gb()
        self.idle()

    def _own_jpegs(self, count: int) -> list[tuple]:
        """The train loader's first `count` batches (data.decode_on=device: the JPEG bytes of the
        run's own images and their crops and augmentation rows), the labels on the device."""
        loader = iter(self.parts.data.train_loader)
        batches = []
        for _ in range(count):
            images, labels, *rows = next(loader)
            batches.append((images, labels.to(self.device), *rows))
        return batches

    def step(self) -> None:
        self.optimizer_step.train_step(self.feed)
        self.state.step += 1

    def close(self) -> None:
        if hasattr(self.feed, "close"):  # data.decode_on=device: its decoding thread
            self.feed.close()

    def idle(self) -> None:
        """Free the gradients while other loops run (the next step starts by dropping them
        anyway)."""
        self.parts.optimizer.zero_grad(set_to_none=True)


class CompileWatch:
    """What torch.compile did while the block ran, read from dynamo's counters: graph breaks and
    recompile-limit hits (code that then runs eager), and with `timed`, any graph compiled at all (a
    timed step that compiles is not a step's time). `faults` names each, with torch's reason."""

    def __init__(self, timed: bool = False):
        self.timed = timed
        self.faults: list[str] = []

    def __enter__(self) -> CompileWatch:
        self.graphs, self.reasons = compile_counts()
        return self

    def __exit__(self, *exc: object) -> None:
        graphs, reasons = compile_counts()
        for reason, n in reasons.items():
            if n > self.reasons.get(reason, 0):
                self.faults.append(f"{n - self.reasons.get(reason, 0)}x {reason}")
        if self.timed and graphs > self.graphs:
            self.faults.append(
                f"{graphs - self.graphs} graph(s) compiled while timed (a recompilation)"
            )


class Timed:
    """One loop of one configuration as the rounds see it: its label ("<configuration>:<loop>"), its
    steps, the seconds they took and what went wrong compiling it (`CompileWatch`), warm-up
    included."""

    def __init__(
        self,
        label: str,
        cfg: DictConfig,
        step: Callable[[], Any],
        idle: Callable[[], Any] = lambda: None,
        attention: Optional[list[str]] = None,
        faults: Optional[list[str]] = None,
    ):
        self.label, self.cfg, self.step, self.idle, self.attention = (
            label,
            cfg,
            step,
            idle,
            attention,
        )
        self.times: list[float] = []
        self.faults = list(faults or [])


def plain_loops(
    cfg: DictConfig, batches: list[tuple], device: torch.device, switches
) -> dict[str, PlainLoop]:
    """This configuration's plain loops (`baseline_roles`), each warmed up on its own, with its peak
    memory."""
    loops = {}
    for role in baseline_roles(cfg):
        apply_switches(cfg, device)
        memory = PeakMemory(device)
        loop = PlainLoop(cfg, role, device, switches)
        with CompileWatch() as watch:
            time_steps(partial(loop.step, batches), max(cfg.bench.warmup, 1), device)
        loop.compile_faults = watch.faults
        loop.peak_memory_gb = memory.increase_gb()
        loops[role] = loop
    return loops
