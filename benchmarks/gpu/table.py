"""One table of the GPU step-rate rows `benchmarks/gpu/run.sh mfu` wrote (results.jsonl): row,
img/s, MFU, ours / best plain loop (speed, above 1: ours is faster), goal and whether it is met.
Exits non-zero when a row compiled with faults (a graph break, a recompile-limit hit, compiling
while timed: `visiondist.bench.harness.CompileWatch`) or a row is missing, so that a run that timed
eager code never passes for a measurement.

    python benchmarks/gpu/table.py benchmarks/gpu/out/results.jsonl [--markdown out.md]

`--levers` (`run.sh levers`): each row's speed against the first row of its own run (the
configuration as it ships, measured beside the lever), no goals and no missing rows; a row that
compiled with faults still fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (model, variant) -> (goal text, test on the row); the variant "-" is the configuration itself
GOALS = {
    ("vit_small", "-"): ("ViT-S/16 >= 10,000 img/s", lambda r: r["images_per_s"] >= 10_000),
    ("vit_base", "-"): (
        "ViT-B/16 DeiT recipe >= 4,200 img/s (45% MFU)",
        lambda r: r["images_per_s"] >= 4_200,
    ),
    ("vit_huge", "-"): ("ViT-H/14 >= 50% MFU", lambda r: (r["mfu_datasheet"] or 0) >= 0.50),
    # (its plain loop on timm's model: `run.sh bench`)
    ("vit_huge", "trainer.fp8=rowwise"): (
        "float8 never slower than bf16",
        lambda r: r["over_first"] <= 1.0,
    ),
}


def speed_over_plain(r: dict) -> float | None:
    """ours / best plain loop as a speed ratio (the JSON keeps the ratio of step times, plain's
    below ours)."""
    return 1.0 / r["ours_over_plain"] if r.get("ours_over_plain") else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument(
        "--levers", action="store_true", help="speed against each run's first row; no goals"
    )
    args = parser.parse_args()
    rows = (
        [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
        if args.results.exists()
        else []
    )
    device = rows[0]["device"] if rows else "?"
    lines = [f"{device}, torch {rows[0]['torch'] if rows else '?'}", ""]
    if args.levers:
        return _levers(rows, lines, args.markdown)
    lines += [
        "| row | compile | img/s | MFU (datasheet) | ours / best plain | goal | met |",
        "|---|---|---|---|---|---|---|",
    ]
    failed = 0
    for r in rows:
        goal, test = GOALS.get(
            (r["model"], r["variant"]), ("every row >= 1.0x the best plain loop", lambda _r: True)
        )
        speed = speed_over_plain(r)
        met = test(r) and (speed is None or speed >= 1.0)
        faults = r.get("compile_faults") or []
        failed += bool(faults)
        name = _row_name(r)
        mfu = f"{100 * r['mfu_datasheet']:.1f}%" if r.get("mfu_datasheet") else "-"
        lines.append(
            f"| {name} | {r['compile_scope']} | {r['images_per_s']:,.0f} | {mfu} | "
            f"{f'{speed:.3f}' if speed else '-'} | {goal} | "
            f"{'FAILED: ' + '; '.join(faults) if faults else ('yes' if met else 'no')} |"
        )
    missing = [
        f"{m} {v}" for m, v in GOALS if not any(r["model"] == m and r["variant"] == v for r in rows)
    ]
    if missing:
        lines += ["", f"missing rows (not run or failed before recording): {', '.join(missing)}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return failed + len(missing)


def _row_name(r: dict) -> str:
    return f"{r['model']} {r['img_size']} b{r['batch']}" + (
        "" if r["variant"] == "-" else f" {r['variant']}"
    )


def _levers(rows: list[dict], lines: list[str], markdown: Path | None) -> int:
    """The levers' table: img/s, MFU, speed over the first row of the row's run (1.000 for that row
    itself) with the ratio's uncertainty, and compile faults (each one fails the table: it timed
    eager code)."""
    lines += [
        "| row | compile | img/s | MFU (datasheet) | speed over its run's first row | faults |",
        "|---|---|---|---|---|---|",
    ]
    failed = 0
    for r in rows:
        faults = r.get("compile_faults") or []
        failed += bool(faults)
        mfu = f"{100 * r['mfu_datasheet']:.1f}%" if r.get("mfu_datasheet") else "-"
        over = r.get("over_first") or 1.0
        spread = (r.get("ratio_uncertainty") or {}).get("over_first")
        lines.append(
            f"| {_row_name(r)} | {r['compile_scope']} | {r['images_per_s']:,.0f} | {mfu} | "
            f"{1.0 / over:.3f}{f' (+-{spread:.1%})' if isinstance(spread, float) else ''} | "
            f"{'FAILED: ' + '; '.join(faults) if faults else '-'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if markdown:
        markdown.write_text(text)
    return failed + (not rows)


if __name__ == "__main__":
    sys.exit(main())
