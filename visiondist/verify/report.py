"""The dry run's report: each rank's figures (measured, planned, their ratio, flagged when off) and
the table. Parameters, gradients and optimizer state must match the planner exactly, the rest within
`TOLERANCE`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from rich.console import JustifyMethod
from rich.table import Table

from visiondist.plan.memory import GB

TOLERANCE = 0.10  # a measured figure further than this from the plan is flagged
# the planner counts these exactly: any difference is flagged
EXACT = ("parameters", "gradients", "optimizer")


@dataclass
class Figure:
    """One figure of a rank, measured and planned.

    Args:
        name: what it counts ("parameters", "activations", "dp all_reduce", ...).
        measured: the bytes the dry run read off the built rank.
        planned: the planner's bytes for it; None where the planner has none.
    """

    name: str
    measured: int
    planned: Optional[int]

    @property
    def ratio(self) -> Optional[float]:
        if self.planned is None:
            return None
        if self.planned == 0:
            return 1.0 if self.measured == 0 else math.inf
        return self.measured / self.planned

    @property
    def off(self) -> bool:
        if self.planned is None:
            return False
        if self.name in EXACT:
            return self.measured != self.planned
        ratio = self.ratio  # planned: a figure
        return ratio is not None and abs(ratio - 1) > TOLERANCE


@dataclass
class RankReport:
    """One measured rank: its figures beside the plan's.

    Args:
        rank: the global rank.
        coordinate: its (pp, dp, tp) coordinate in the mesh.
        figures: its figures: bytes by component, then collective bytes per step.
        seconds: how long building and stepping it took.
    """

    rank: int
    coordinate: tuple[int, int, int]  # (pp, dp, tp)
    figures: list[Figure] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def flagged(self) -> list[Figure]:
        return [f for f in self.figures if f.off]

    def figure(self, name: str) -> Figure:
        return next(f for f in self.figures if f.name == name)


def _gb(n: int) -> str:
    if n >= 1e8 or n == 0:
        return f"{n / GB:.4g}"
    return f"{n / 1e6:.3g} MB" if n >= 1e4 else f"{n} B"


def report_table(reports: list[RankReport], title: str = ""):
    """A rich Table: per rank and figure, measured GB, planned GB, ratio; flagged rows in red.

    Args:
        reports: the dry run's ranks (`dry_run`'s result).
        title: the table's title ("": none).

    Returns:
        The `rich.table.Table`, for a rich `Console` to print.
    """
    table = Table(
        title=title or None,
        title_justify="left",
        caption=(
            "GB per rank (unless marked MB or B); collectives: bytes per optimizer step, each "
            "call's payload; parameters, gradients and optimizer state must match exactly, the "
            f"rest within {100 * TOLERANCE:.0f}%"
        ),
        caption_justify="left",
    )
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("rank (pp, dp, tp)", "left"),
        ("figure", "left"),
        ("measured", "right"),
        ("planned", "right"),
        ("ratio", "right"),
        ("", "left"),
    )
    for col, justify in columns:
        table.add_column(col, justify=justify, no_wrap=True)
    for report in reports:
        for i, f in enumerate(report.figures):
            who = f"{report.rank} {report.coordinate}" if i == 0 else ""
            ratio = "-" if f.ratio is None else f"{f.ratio:.3f}"
            table.add_row(
                who,
                f.name,
                _gb(f.measured),
                "-" if f.planned is None else _gb(f.planned),
                ratio,
                "OFF" if f.off else "",
                style="bold red" if f.off else None,
                end_section=i == len(report.figures) - 1,
            )
    return table
