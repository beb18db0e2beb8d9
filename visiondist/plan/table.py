"""A plan's result: one row per candidate layout (its busiest rank's memory, its step time, whether
it fits), the choice and why, drawn as a rich table (`tools/plan.py`, the launcher's refusal) or
written as JSON (`plan.json` in a run dir).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from visiondist.models.shape import ViTShape
from visiondist.plan.memory import GB, RankMemory
from visiondist.plan.time_model import Candidate, Hardware


@dataclass
class PlanRow:
    candidate: Candidate
    memory: Optional[RankMemory]
    seconds: Optional[dict]
    fits: bool
    note: str = ""

    def planned(self) -> tuple[RankMemory, dict]:
        """(memory, step seconds) of a row that was planned: every row that fits; a row without
        them (a split that cannot be made) names why in `note`."""
        if self.memory is None or self.seconds is None:
            raise ValueError(f"{self.candidate.name} was not planned: {self.note}")
        return self.memory, self.seconds


def duration(seconds: float) -> str:
    return (
        f"{seconds:.3g} s"
        if seconds >= 10
        else f"{seconds:.2f} s"
        if seconds >= 1
        else f"{1e3 * seconds:.3g} ms"
    )


@dataclass
class Plan:
    shape: ViTShape
    hardware: Hardware
    global_batch: int
    rows: list[PlanRow]
    choice: Optional[PlanRow]
    reason: str
    # bytes of one whole block's parameters, gradients, optimizer state (and EMA)
    layer_state: int = 0
    grad_accum: int = 1  # the configured accumulation, which plain DDP keeps

    @property
    def plain_ddp(self) -> bool:
        """Whether the choice is plain DDP as configured (no checkpointing, no more
        accumulation)."""
        return self.choice is not None and self.choice.candidate == Candidate(
            self.hardware.devices, accum=self.grad_accum
        )

    def table(self, title: str = ""):
        """A rich Table: per-rank GB by component, estimated step time, fits."""
        # rich where a table is drawn: 30-50 ms of `tools/train.py --cfg job`, which draws none
        from rich.table import Table  # noqa: PLC0415 (rich: 30-50 ms, drawn on demand)

        table = Table(
            title=title or None,
            title_justify="left",
            caption="GB per device (busiest rank, 1 GB = 1e9 bytes); each layout with the least "
            "accumulation (+accumN) that fits it; micro: images a rank computes at once "
            "(global batch / dp / accumulation / pipeline micro-batches); state = "
            "parameters + gradients + optimizer (+ EMA); activations: at the rank's peak "
            "(every micro-batch in flight); step: time model",
            caption_justify="left",
        )
        table.add_column("layout", no_wrap=True)
        for col in ("micro", "state", "activations", "buffers", "device", "host", "step", "fits"):
            table.add_column(col, justify="right")
        for row in self.rows:
            m = row.memory
            chosen = row is self.choice
            cells = [row.candidate.name]
            if m is None or row.seconds is None:  # both or neither: a row that was not planned
                cells += ["-"] * 6 + ["-", f"no: {row.note}"]
            else:
                cells += [
                    str(m.detail["micro_batch"]),
                    f"{m.state / GB:.2f}",
                    f"{m.activations / GB:.2f}",
                    f"{m.buffers / GB:.2f}",
                    f"{m.device / GB:.2f}",
                    f"{m.host / GB:.2f}" if m.offloaded else "-",
                    duration(row.seconds["total"]),
                    "yes" if row.fits else f"no: {row.note}" if row.note else "no",
                ]
            table.add_row(
                *cells, style="bold green" if chosen else ("dim" if not row.fits else None)
            )
        return table

    def text(self, title: str = "", width: int = 120) -> str:
        from rich.console import Console  # noqa: PLC0415 (rich: 30-50 ms, drawn on demand)

        console = Console(width=width, record=True, file=open("/dev/null", "w"))
        console.print(self.table(title))
        return console.export_text()

    def to_json(self) -> dict:
        return {
            "hardware": self.hardware.__dict__,
            "global_batch": self.global_batch,
            "layer_state_gb": self.layer_state / GB,
            "choice": None if self.choice is None else self.choice.candidate.__dict__,
            "reason": self.reason,
            "rows": [
                {
                    "layout": r.candidate.name,
                    **r.candidate.__dict__,
                    "fits": r.fits,
                    "note": r.note,
                    **(
                        {
                            "micro_batch": r.memory.detail["micro_batch"],
                            "device_gb": r.memory.device / GB,
                            "host_gb": r.memory.host / GB,
                            "state_gb": r.memory.state / GB,
                            "activations_gb": r.memory.activations / GB,
                            "buffers_gb": r.memory.buffers / GB,
                            "step_s": r.seconds["total"],
                        }
                        if r.memory and r.seconds
                        else {}
                    ),
                }
                for r in self.rows
            ],
        }
