"""Evaluate trained weights on the val split of a config's data:

    # the run's config.yaml + model.safetensors
    python tools/eval.py run_dir=<run dir> [key=value ...]
    # its checkpoints/step_<N>, any layout
    python tools/eval.py run_dir=<run dir> step=<N> [key=value ...]
    python tools/eval.py weights=<file or folder> model=... data=... [key=value ...]

Prints the result (for detectors the 12-line COCOeval summary) and writes eval.json (and
detections.json, COCO results format) into <run dir>/eval/<date>_<time>/ (weights=:
outputs/eval/<date>_<time>/), or trainer.run_dir. Runs its own ranks like train.py. The old
spelling, a bare path (`tools/eval.py <run dir>`), still works.
"""

import re
import sys
from pathlib import Path

from visiondist.cli import (
    Command,
    Tool,
    config_text,
    exit_now,
    truth,
)
from visiondist.cli import main as cli_main
from visiondist.config import ConfigError
from visiondist.utils.dcp import is_complete

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOOL = Tool(
    name="eval.py",
    about=(
        "Evaluate trained weights on the val split (top-1 / top-5, or COCO box mAP with the "
        "12-line summary for detectors); runs its own ranks like tools/train.py."
    ),
    keys=(
        (
            "run_dir=<dir>",
            "a training run: evaluated under its config.yaml with its model.safetensors (else its "
            "newest checkpoint); takes group.key=value overrides such as data.root=/path, no "
            "group=option",
        ),
        (
            "step=<N>",
            "with run_dir: its checkpoint checkpoints/step_<N> instead, whatever layout wrote it; "
            "step=best: the best one by trainer.best_metric",
        ),
        (
            "ema=true",
            "the checkpoint's EMA of the weights (trainer.ema_decay > 0; the newest checkpoint "
            "unless step=): the model the run's val_ema_* figures scored; step=best by a "
            "val_ema_* metric reads it without",
        ),
        (
            "weights=<path>",
            "what model.weights takes (a .safetensors or torch file in this project's, timm's or "
            "torchvision's keys; a DETR-class detector's from_pretrained directory, format=hf's "
            "model_hf/) or a checkpoint directory, or an exported .onnx / .pt2 file run by its "
            "runtime (docs/deploy.md), evaluated under the config composed from group=option / "
            "group.key=value as in tools/train.py",
        ),
    ),
    reads="the weights, the run's config.yaml (or configs/), the val split of the data",
    writes=(
        "eval.json (detectors: detections.json), per_class.json, the plots, config.yaml and "
        "eval.log into <run>/eval/<date>_<time>/ (run_dir=<run>) or outputs/eval/<date>_<time>/ "
        "(weights=; trainer.output_dir), or into hydra.run.dir=DIR / trainer.run_dir=DIR; prints "
        "where"
    ),
    examples=(
        "python tools/eval.py run_dir=outputs/2026-11-21/21-10-24",
        "python tools/eval.py run_dir=outputs/2026-11-21/21-10-24 step=500 "
        "data.root=/data/imagenet",
        "python tools/eval.py weights=vit_small.safetensors model=vit_small data=imagenet "
        "data.root=/data/imagenet",
    ),
    multirun=False,
    positional=True,
)


def evaluate(cmd: Command) -> int:
    from visiondist.api.jobs import evaluate_job, evaluation_config  # visiondist.evaluate's job

    args = _arguments(cmd)
    if cmd.config_dir is not None and "run_dir" in args:
        raise ConfigError(
            "-cd: run_dir= evaluates under the run's own config.yaml; -cd adds options for weights="
        )
    ema = ["model.weights_ema=true"] if truth("ema", args.get("ema", "false")) else []
    cfg, base = evaluation_config(
        args.get("run_dir"),
        args.get("step"),
        args.get("weights"),
        cmd.overrides + ema + (cmd.search if "weights" in args else []),
    )
    if cmd.show:
        print(config_text(cfg, cmd.package))
        return 0
    evaluate_job(cfg, base, own_dir=any(o.startswith("trainer.run_dir=") for o in cmd.overrides))
    return 0


def _arguments(cmd: Command) -> dict:
    """The tool keys, with the old spelling (a bare path) turned into them and a one-line notice of
    the new one."""
    if len(cmd.paths) > 1:
        raise ConfigError(f"{' '.join(cmd.paths)}: give one run_dir=<run dir> or weights=<file>")
    if not cmd.paths:
        return cmd.args
    if cmd.args.keys() & {"run_dir", "weights"}:
        raise ConfigError(f"{cmd.paths[0]}: give run_dir= or weights= once")
    path = Path(cmd.paths[0]).expanduser()
    run = path.parent.parent
    if (
        is_complete(path)
        and re.fullmatch(r"checkpoints/step_\d+", f"{path.parent.name}/{path.name}")
        and (run / "config.yaml").is_file()
    ):
        new = {"run_dir": str(run), "step": path.name[len("step_") :]}
    # not from_pretrained's
    elif path.is_dir() and not is_complete(path) and not (path / "config.json").is_file():
        new = {"run_dir": cmd.paths[0]}
    else:
        new = {"weights": cmd.paths[0]}
    spelled = " ".join(f"{k}={v}" for k, v in new.items())
    print(
        f"tools/eval.py {cmd.paths[0]}: a bare path is deprecated: write tools/eval.py {spelled}",
        file=sys.stderr,
        flush=True,
    )
    return {**cmd.args, **new}


def main(argv: list[str]) -> int:
    try:
        return cli_main(TOOL, CONFIGS, argv, evaluate)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # without the interpreter's teardown (visiondist.utils.exit)
