"""Evaluate trained weights on the val split of a config's data:

    python tools/eval.py <run dir> [key=value ...]                   # the run's config.yaml + model.safetensors
    python tools/eval.py <run dir>/checkpoints/step_<N> [key=value ...]   # a checkpoint, any layout it was saved in
    python tools/eval.py <weights.safetensors> model=... data=... [key=value ...]

Prints the result (for detectors the 12-line COCOeval summary) and writes eval.json (and detections.json, COCO
results format) into <run dir>/eval/<date-time>/, or trainer.run_dir. Runs its own ranks like train.py.
"""

import sys
from pathlib import Path

from visiondist.cli import USAGE, checked, load_config, load_run_config
from visiondist.config import ConfigError
from visiondist.engine.checkpoint import is_complete, latest_checkpoint

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or "=" in argv[0]:
        print(__doc__ + "\n" + USAGE.format(tool="eval.py"))
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    source, overrides = Path(argv[0]).expanduser(), argv[1:]
    try:
        if is_complete(source):  # <run>/checkpoints/step_<N>
            run = source.parent.parent
            cfg, weights = load_run_config(run, overrides, inputs=None), source
            out = run / "eval"
        elif source.is_dir():
            cfg = load_run_config(source, overrides, inputs=None)
            weights = source / "model.safetensors"
            if not weights.is_file():  # e.g. a run stopped early: its newest checkpoint, if it has one
                weights = latest_checkpoint(source) or weights
            out = source / "eval"
        else:
            cfg, weights, out = load_config(CONFIGS, overrides, inputs=None), source, None
        if not weights.exists():
            raise FileNotFoundError(f"no weights at {weights}: give a run dir holding model.safetensors or a "
                                    "checkpoint, a checkpoints/step_<N> directory or a weights file")
        cfg.model.weights = str(weights.resolve())
        checked(cfg, "eval")  # class count, val split, weights against the model, before any rank starts
        from visiondist.engine.trainer import evaluate_checkpoint
        from visiondist.launch import launch, unique_dir

        if out is not None and not any(o.startswith("trainer.run_dir=") for o in overrides):
            cfg.trainer.run_dir = str(unique_dir(out, "%Y-%m-%d_%H-%M-%S"))  # <run>/eval/<date>_<time>
        from visiondist.launch import RunFailed

        try:
            launch(evaluate_checkpoint, cfg)
        except RunFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
