"""Benchmark the training step: `python tools/benchmark.py [group=option ...] [key=value ...]`.

The same configs as tools/train.py, plus `bench.*` (warm-up, timed steps, rounds, baseline, peak, loader batches,
results_dir). Times visiondist's step and, for each configuration, plain PyTorch loops built from it (on timm's
model and on visiondist's own) side by side, in alternating order, and appends the results to results.jsonl and
results.md in the run dir (outputs/<date>/<time>/, or bench.results_dir). Example:

    python tools/benchmark.py model=vit_base data.img_size=224 data.batch_size=128 trainer.precision=bf16 \
        trainer.compile=true
"""

import sys
from pathlib import Path

from visiondist.cli import run_tool

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main(cfg) -> int:
    from visiondist.engine.benchmark import run_benchmark
    from visiondist.launch import JobStopped, launch

    try:
        launch(run_benchmark, cfg)
    except JobStopped as stopped:  # Ctrl-C / SIGTERM: the step in flight finished, nothing was recorded
        print(f"benchmark stopped by {stopped.signal_name}: nothing recorded", file=sys.stderr, flush=True)
        return stopped.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(run_tool("benchmark.py", CONFIGS, sys.argv[1:], main))
