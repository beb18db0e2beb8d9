"""Train a model: `python tools/train.py [group=option ...] [key=value ...]` (see configs/train.yaml).

Runs its own ranks (parallel.dp / tp / pp, or all GPUs), or joins a torchrun job.
"""

import sys
from pathlib import Path

from visiondist.cli import run_tool

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main(cfg) -> int:
    from visiondist.engine.trainer import train  # heavy imports only once the config is known to be good
    from visiondist.launch import JobStopped, launch
    from visiondist.runs import completed_step

    step = completed_step(cfg)
    if step is not None:  # e.g. a requeued cluster job: nothing to do, nothing rewritten
        print(f"{cfg.trainer.run_dir} is complete at step {step}: nothing to do (to train longer, raise "
              "trainer.max_steps or trainer.max_epochs)", flush=True)
        return 0

    try:
        launch(train, cfg)
    except JobStopped as stopped:  # every rank wrote its checkpoint first
        print(stopped, file=sys.stderr, flush=True)
        return stopped.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(run_tool("train.py", CONFIGS, sys.argv[1:], main))
