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
from typing import Optional

from visiondist.cli import (
    Command,
    Tool,
    checked,
    config_text,
    exit_now,
    load_run_config,
    load_weights_config,
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
            "weights=<path>",
            "what model.weights takes (a .safetensors or torch file in this project's, timm's or "
            "torchvision's keys; a DETR-class detector's from_pretrained directory, format=hf's "
            "model_hf/) or a checkpoint directory, evaluated under the config composed from "
            "group=option / group.key=value as in tools/train.py",
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
    cfg, weights, base = _source(cmd)
    cfg.model.weights = str(weights.resolve())
    cfg.model.init_from = None  # a fine-tuned run: its own weights, not the ones it started from
    if cmd.show:
        print(config_text(cfg, cmd.package))
        return 0
    try:  # the val split and the weights against the model, before any rank starts
        checked(cfg, "eval")
    except ConfigError as exc:
        if base is not None:  # run_dir=: the run's own weights
            raise
        # this tool's key
        raise ConfigError(str(exc).replace("model.weights=", "weights=")) from None
    from visiondist.engine.run import evaluate_checkpoint
    from visiondist.launch import launch

    # eval/<date>_<time> under `base`
    if not any(o.startswith("trainer.run_dir=") for o in cmd.overrides):
        cfg.trainer.run_dir = None
        cfg.trainer.output_dir = str(base) if base is not None else cfg.trainer.output_dir
    launch(evaluate_checkpoint, cfg)
    return 0


def _source(cmd: Command):
    """(config, weights, the folder whose eval/ gets the results: the run's, or None for
    trainer.output_dir)."""
    args = _arguments(cmd)
    if "weights" in args and "run_dir" in args:
        raise ConfigError(
            "give run_dir=<run> (evaluated under its config.yaml) or weights=<file> (under the "
            "config of group=option / key=value), not both"
        )
    if "step" in args and "run_dir" not in args:
        raise ConfigError(f"step={args['step']} picks a checkpoint of a run: add run_dir=<run>")
    if "weights" in args:
        weights = Path(args["weights"]).expanduser()
        if not weights.exists():
            raise ConfigError(f"weights={args['weights']}: no such file or checkpoint directory")
        return (
            load_weights_config(
                CONFIGS, weights, cmd.overrides + cmd.search, "eval.py", data_needed=True
            ),
            weights,
            None,
        )
    if "run_dir" not in args:
        raise ConfigError(
            "give run_dir=<run dir> (a training run) or weights=<file> with model=... data=...: "
            "--help shows both"
        )
    if cmd.config_dir is not None:
        raise ConfigError(
            "-cd: run_dir= evaluates under the run's own config.yaml; -cd adds options for weights="
        )
    run = Path(args["run_dir"]).expanduser()
    cfg = load_run_config(run, cmd.overrides, inputs=None)
    from visiondist.inference.job import (
        run_weights,  # the run's weights as tools/predict.py takes them
    )

    return cfg, run_weights(run, _step(args["step"]) if "step" in args else None), run


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


def _step(value: Optional[str]) -> "int | str":
    if value == "best":
        return value
    try:
        return int(str(value))
    except ValueError:
        raise ConfigError(
            f"step={value}: give a checkpoint's step number, e.g. step=500, or step=best"
        ) from None


def main(argv: list[str]) -> int:
    try:
        return cli_main(TOOL, CONFIGS, argv, evaluate)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # without the interpreter's teardown (visiondist.utils.exit)
