"""Training losses of runs side by side: one PNG, and a table of the loss every `--every` steps with
each run's relative difference from the first (the reference). `benchmarks/gpu/run.sh kernels`
compares a float8 run with bf16's.

    python benchmarks/loss_curves.py outputs/bf16_run outputs/fp8_run --labels bf16 fp8 \
        --png fp8_loss.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from visiondist.observe.metrics import read_metrics


def losses(run: Path) -> dict[int, float]:
    return {
        int(r["step"]): float(r["loss"])
        for r in read_metrics(run / "metrics.csv")
        if r["loss"] is not None
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs", nargs="+", type=Path, help="run directories (the first is the reference)"
    )
    parser.add_argument("--labels", nargs="+")
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    labels = args.labels or [run.name for run in args.runs]
    curves = [losses(run) for run in args.runs]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, curve in zip(labels, curves):
        ax.plot(
            list(curve),
            list(curve.values()),
            label=label,
            linewidth=1,
            marker="." if len(curve) < 30 else None,
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    common = [s for s in sorted(curves[0]) if all(s in c for c in curves)]
    if not common:
        raise SystemExit(
            f"the runs share no logged step ({', '.join(f'{len(c)} steps' for c in curves)})"
        )
    # a short run: every step it logged
    steps = [s for s in common if s % args.every == 0] or common
    print("| step | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for s in steps:
        ref = curves[0][s]
        cells = [f"{ref:.4f}"] + [f"{c[s]:.4f} ({(c[s] - ref) / ref:+.1%})" for c in curves[1:]]
        print(f"| {s} | " + " | ".join(cells) + " |")
    print(f"written: {args.png}")


if __name__ == "__main__":
    main()
