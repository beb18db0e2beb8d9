"""What a pipeline schedule did: per-rank compute intervals, the bubble fraction and a PNG timeline.

Each rank records one interval per stage action (F: forward of a micro-batch; B: its backward, input
and weight gradients together; I and W: the input-gradient and weight-gradient halves that
zero-bubble schedules run apart), timed from the moment every rank left a barrier (host clock on the
CPU, CUDA events on a GPU). Waiting for a neighbour's activations or gradients is not recorded: it
is the bubble.

    bubble = 1 - sum of busy time over ranks / (ranks x span)

where `span` runs from the first action's start to the last action's end on any rank. With equal
stages and free communication GPipe and 1F1B give (p - 1) / (m + p - 1) for p ranks and m
micro-batches.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

PHASES = {
    "F": "forward",
    "B": "backward",
    "I": "backward (input grad)",
    "W": "backward (weight grad)",
}
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868"}


@dataclass
class Event:
    rank: int  # rank within the pipeline group
    stage: int
    phase: str  # F, B, I or W
    microbatch: int
    start: float  # seconds since the recording started
    end: float


class Recorder:
    """Collects this rank's `Event`s while `record()` is active; the stages report to it.

    On the CPU an action is timed by the host clock around it. On CUDA the host only queues work, so
    each action gets a pair of CUDA events on the current stream instead, and they are read once the
    step is over: nothing in the step waits for the device (a `synchronize` per action would
    serialise the step and can deadlock against queued NCCL sends). A stage starts an action after
    waiting for its input, so the events exclude that wait, as the host clock does on the CPU."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.events: list[Event] = []
        self.active = False
        self._t0 = 0.0
        self._cuda = device.type == "cuda"
        self._queued: list[tuple] = []  # CUDA: (stage, phase, microbatch, start event, end event)
        self._start_event: Optional[torch.cuda.Event] = None

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def record(self, barrier=None) -> Iterator[Recorder]:
        """Record the actions run inside the block; `barrier` (e.g. the pipeline group's) aligns the
        clocks. On CUDA the device is drained once before (so its clock starts with the host's) and
        the events are read after."""
        self.events, self._queued = [], []
        if self._cuda:
            torch.cuda.synchronize(self.device)
        if barrier is not None:
            barrier()
        self._t0 = time.perf_counter()
        if self._cuda:
            self._start_event = self._event()
        self.active = True
        try:
            yield self
        finally:
            self.active = False
            if self._cuda:
                self._read_events()

    def _read_events(self) -> None:
        if self._queued:
            # the stream's last event: every earlier one has completed too
            self._queued[-1][-1].synchronize()
        start = self._start_event
        if start is None:  # `record` sets it before any action is queued
            if self._queued:
                raise RuntimeError("CUDA events queued outside Recorder.record")
            return
        for stage, phase, microbatch, begin, end in self._queued:
            self.events.append(
                Event(
                    self.rank,
                    stage,
                    phase,
                    microbatch,
                    start.elapsed_time(begin) / 1e3,
                    start.elapsed_time(end) / 1e3,
                )
            )
        self._queued = []

    @contextmanager
    def action(self, stage: int, phase: str, microbatch: int) -> Iterator[None]:
        if not self.active:
            yield
            return
        if self._cuda:
            begin = self._event()
            try:
                yield
            finally:
                self._queued.append((stage, phase, microbatch, begin, self._event()))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.events.append(
                Event(
                    self.rank,
                    stage,
                    phase,
                    microbatch,
                    start - self._t0,
                    time.perf_counter() - self._t0,
                )
            )


def bubble_fraction(events: Sequence[Event], ranks: Optional[int] = None) -> dict:
    """Busy time per rank, the span and the bubble fraction (overall and per rank) of one recorded
    step."""
    if not events:
        raise ValueError("no pipeline events were recorded")
    ranks = ranks or (max(e.rank for e in events) + 1)
    begin, end = min(e.start for e in events), max(e.end for e in events)
    span = end - begin
    busy = [sum(e.end - e.start for e in events if e.rank == r) for r in range(ranks)]
    return {
        "span_s": span,
        "busy_s": busy,
        "bubble": 1.0 - sum(busy) / (ranks * span),
        "bubble_per_rank": [1.0 - b / span for b in busy],
    }


def ideal_bubble(pp: int, microbatches: int) -> float:
    """GPipe's and 1F1B's bubble with equal stages and free communication: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (microbatches + pp - 1)


def to_json(events: Sequence[Event]) -> list[dict]:
    return [asdict(e) for e in events]


def from_json(rows: Sequence[dict]) -> list[Event]:
    return [Event(**row) for row in rows]


def plot_timeline(events: Sequence[Event], path: Path, title: str) -> Path:
    """Ranks (rows) x time, one box per action coloured by phase and labelled with its micro-batch;
    the later virtual stages of a rank are drawn lighter."""
    # matplotlib (0.4 s) only where a timeline is drawn; drawn by Agg when saved, no pyplot
    from matplotlib.figure import Figure  # noqa: PLC0415 (matplotlib: drawn on demand)
    from matplotlib.patches import Patch  # noqa: PLC0415 (matplotlib: drawn on demand)

    stats = bubble_fraction(events)
    ranks = len(stats["busy_s"])
    begin = min(e.start for e in events)
    scale = 1e3  # ms
    first_stage = {r: min(e.stage for e in events if e.rank == r) for r in range(ranks)}
    fig = Figure(figsize=(12, 0.7 * ranks + 1.6))
    ax = fig.subplots()
    for e in events:
        x0, width = (e.start - begin) * scale, (e.end - e.start) * scale
        later = e.stage != first_stage[e.rank]
        ax.broken_barh(
            [(x0, width)],
            (e.rank - 0.4, 0.8),
            facecolors=COLOURS[e.phase],
            alpha=0.55 if later else 1.0,
            edgecolor="white",
            linewidth=0.5,
        )
        if width > stats["span_s"] * scale / 150:
            ax.text(
                x0 + width / 2,
                e.rank,
                str(e.microbatch),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, stats["span_s"] * scale)
    phases = sorted({e.phase for e in events}, key="FBIW".index)
    ax.legend(
        handles=[Patch(color=COLOURS[p], label=PHASES[p]) for p in phases],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18 if ranks > 2 else -0.3),
        ncol=len(phases),
        frameon=False,
    )
    ax.set_title(f"{title} | bubble {100 * stats['bubble']:.1f}%")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
