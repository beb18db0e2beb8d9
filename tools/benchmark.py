"""Benchmark the training step: `python tools/benchmark.py [flags] [group=option ...]
[group.key=value ...]`.

The same configs as tools/train.py, plus `bench.*` (warm-up, timed steps, rounds, baseline, peak,
loader batches, results_dir, variants). Times visiondist's step and, for each configuration, plain
PyTorch loops built from it (on timm's model and on visiondist's own) side by side, in alternating
order, and appends the results to results.jsonl and results.md in its run dir
(outputs/benchmark/<date>_<time>/, or bench.results_dir). Example:

    python tools/benchmark.py model=vit_base data.img_size=224 data.batch_size=128 \
        trainer.precision=bf16 trainer.compile=true
"""

import sys
from pathlib import Path

from visiondist.cli import Tool, exit_now, run_tool

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOOL = Tool(
    name="benchmark.py",
    about=(
        "Time the training step of a config against plain PyTorch loops built from it (timm's "
        "model and visiondist's) and the device's peak; bench.* says what to time (bench.steps, "
        'bench.rounds, bench.variants=["trainer.compile=true"], ...).'
    ),
    reads="configs/ as tools/train.py (plus bench.*), a few batches of the data under data.root",
    writes=(
        "a run dir outputs/benchmark/<date>_<time>/ (trainer.output_dir; or hydra.run.dir=DIR / "
        "trainer.run_dir=DIR): benchmark.log, benchmark.json, config.yaml, and the results "
        "appended to results.jsonl and results.md there, or in bench.results_dir=DIR (e.g. "
        "benchmarks/)"
    ),
    examples=(
        "python tools/benchmark.py model=vit_base data.img_size=224 trainer.precision=bf16",
        "python tools/benchmark.py model=vit_tiny trainer.accelerator=cpu "
        "bench.variants=[trainer.compile=true]",
        "python tools/benchmark.py -m model=vit_tiny,vit_small bench.results_dir=benchmarks",
    ),
)


def run(cfg) -> int:
    from visiondist.api.jobs import benchmark_job  # visiondist.benchmark's job (torch: 2 s)

    benchmark_job(cfg)
    return 0


def main(argv: list[str]) -> int:
    return run_tool(TOOL, CONFIGS, argv, run)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # without the interpreter's teardown (visiondist.utils.exit)
