"""Train a model: `python tools/train.py [flags] [group=option ...] [group.key=value ...]` (see
configs/train.yaml and `--help`).

Runs its own ranks (parallel.dp / tp / pp, or all GPUs), or joins a torchrun job; -m runs a sweep.
"""

import sys
from pathlib import Path

from visiondist.cli import Tool, exit_now, run_tool

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOOL = Tool()  # the defaults are this tool's


def run(cfg) -> int:
    from visiondist.api.jobs import train_job  # the job visiondist.train runs (torch: 2 s)

    # a stop signal: `launch.JobStopped`, whose line says what was kept (visiondist.cli prints it)
    train_job(cfg)
    return 0


def main(argv: list[str]) -> int:
    return run_tool(TOOL, CONFIGS, argv, run)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # without the interpreter's teardown (visiondist.utils.exit)
