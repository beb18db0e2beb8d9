"""The bytes a benchmarked layout's collectives moved against the planner's figures: for the last
row of a tools/benchmark.py results.jsonl (TP bytes per step as the TP group's counter measured
them, ring-weighted; pipeline sends), the planner's bytes for the same config on the same ranks
(`visiondist.plan.traffic.collective_bytes`, the figures the time model and the dry run use, for
rank 0). Exits non-zero when a measured figure is more than 1% off its planned one, or the row moved
nothing the plan says it should.

    python benchmarks/gpu/traffic.py <results.jsonl> <the benchmark's overrides...>
    python benchmarks/gpu/traffic.py out/results.jsonl model=vit_huge parallel=tp4 \
        data.batch_size=64 trainer.precision=bf16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 0.01


def planned(overrides: list[str], ranks: int) -> dict[str, float]:
    """Rank 0's planned bytes per optimizer step, as the benchmark's counters count them: the TP
    collectives' payloads weighted as a ring moves them (2(n-1)/n for an all-reduce, (n-1)/n for a
    gather or scatter), and the pipeline's sends."""
    from visiondist.cli import load_config
    from visiondist.models.registry import spec_of
    from visiondist.plan import resolve_on
    from visiondist.verify.measure import planned_rank

    cfg = load_config(REPO / "configs", overrides, inputs=None)
    run = resolve_on(cfg, ranks, 1)
    _, traffic = planned_rank(cfg, spec_of(cfg.model).planner_shape(cfg.model), run, (0, 0, 0))
    ring = (run.tp - 1) / run.tp
    tp = 2 * ring * traffic.get("tp all_reduce", 0) + ring * (
        traffic.get("tp all_gather", 0) + traffic.get("tp reduce_scatter", 0)
    )
    return {"tp_bytes_per_step": tp, "pp_bytes_per_step": float(traffic.get("pp send", 0))}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument(
        "overrides", nargs="*", help="the benchmark's config overrides (group=option key=value)"
    )
    args = parser.parse_args(argv)
    rows = (
        [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
        if args.results.is_file()
        else []
    )
    if not rows:
        print(f"error: {args.results} holds no benchmark row", file=sys.stderr)
        return 1
    row = rows[-1]
    plan = planned(args.overrides, int(row["ranks"]))
    print(f"{row['model']} | {row['layout']} | {row['device']}, torch {row['torch']}")
    print("| per step, rank 0 | measured MB | planned MB | measured / planned |")
    print("|---|---|---|---|")
    failed = 0
    for key, name in (
        ("tp_bytes_per_step", "TP collectives (ring bytes)"),
        ("pp_bytes_per_step", "pipeline sends"),
    ):
        got, want = float(row[key]), plan[key]
        ratio = got / want if want else (1.0 if got == 0 else float("inf"))
        off = abs(ratio - 1) > TOLERANCE
        failed += off
        print(
            f"| {name} | {got / 1e6:.3f} | {want / 1e6:.3f} | {ratio:.4f}{' OFF' if off else ''} |"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
