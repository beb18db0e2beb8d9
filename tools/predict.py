"""Predict with trained weights on new images, a folder, a glob, a list of paths or a video:

    python tools/predict.py run_dir=<run dir> source=<images> [key=value ...]
    python tools/predict.py weights=<file or folder> model=... data=... source=<images> \
        [key=value ...]

Writes predictions.csv (classifiers) or detections.jsonl and results.json (detectors), drawn images
and, for a video, the annotated video into <run>/predict/<date>_<time>/ (weights=:
outputs/predict/...) or out=<dir>, as the results arrive. Runs its own ranks like train.py
(trainer.devices=N; torchrun, srun), each with whole batches of the source. The same command again
continues a stopped prediction, or says that it is complete.
"""

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

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# tool key -> (predict.<field>, how its text is read)
SETTINGS = {
    "source": ("source", str),
    "out": ("out", str),
    "topk": ("topk", int),
    "score_thresh": ("score_thresh", float),
    "max_det": ("max_det", int),
    "classes": ("classes", None),
    "save_images": ("save_images", str),
    "vid_stride": ("vid_stride", int),
    "batch": ("batch_size", int),
    "save_txt": ("save_txt", bool),
}
TOOL = Tool(
    name="predict.py",
    about=(
        "Predict with trained weights on new images (an image, a folder, a glob, a .txt list, a "
        "video): CSV or COCO / JSON Lines files and drawn images; runs its own ranks like "
        "tools/train.py, continues when run again."
    ),
    keys=(
        (
            "run_dir=<dir>",
            "a training run: its model.safetensors (else its newest checkpoint) under its "
            "config.yaml; takes group.key=value overrides, no group=option",
        ),
        (
            "step=<N>",
            "with run_dir: its checkpoint checkpoints/step_<N> (or step=best), whatever layout "
            "wrote it",
        ),
        (
            "ema=true",
            "the checkpoint's EMA of the weights, as tools/eval.py takes it (the newest "
            "checkpoint unless step=)",
        ),
        (
            "weights=<path>",
            "weights as tools/eval.py takes them (a .safetensors or torch file, a checkpoint, a "
            "from_pretrained directory, an exported .onnx / .pt2 file run by its runtime), under "
            "the config of group=option / group.key=value",
        ),
        (
            "source=<path>",
            "an image, a folder of images (searched recursively), a glob in quotes, a .txt file of "
            "image paths, or a video (.mp4, .avi, .mov, .mkv, .webm)",
        ),
        (
            "out=<dir>",
            "where the files go (default <run>/predict/<date>_<time>/; weights=: "
            "outputs/predict/...)",
        ),
        ("topk=<k>", "classifiers: the labels kept per image with their probabilities (default 5)"),
        (
            "score_thresh=<s>",
            "detectors: the lowest score kept (default 0.25; 0 keeps what the model gives)",
        ),
        ("max_det=<n>", "detectors: at most n detections per image (default 100)"),
        ("classes=<a,b>", "detectors: only these class names (or COCO category ids)"),
        ("save_images=<n>", "draw the first n images into images/ (default 32; all; 0: none)"),
        ("vid_stride=<n>", "a video: every n-th frame (default 1)"),
        (
            "save_txt=true",
            "detectors: also labels/<image>.txt, YOLO's form (class cx cy w h score, normalised)",
        ),
        ("batch=<n>", "images per forward on each rank (default data.eval_batch_size)"),
    ),
    reads="the weights, the run's config.yaml (or configs/), the source's images",
    writes=(
        "predictions.csv (classifiers) or detections.jsonl + results.json (detectors; labels/ "
        "with save_txt=true), images/, unreadable.txt, predict.json, predict.log and config.yaml "
        "into <run>/predict/<date>_<time>/ or out=<dir>; prints where"
    ),
    examples=(
        "python tools/predict.py run_dir=outputs/2026-11-21/21-10-24 source=photos/",
        "python tools/predict.py run_dir=outputs/2026-11-21/21-10-24 source='photos/**/*.jpg' "
        "topk=3",
        "python tools/predict.py run_dir=outputs/frcnn source=street.mp4 vid_stride=5 "
        "score_thresh=0.5",
        "python tools/predict.py weights=vit_small.safetensors model=vit_small data=imagenet "
        "source=photos/ trainer.devices=2",
    ),
    multirun=False,
    run_dir=False,  # its folder is out=
)


def predict(cmd: Command) -> int:
    from visiondist.api.predict_job import predict_job, prediction_job_config

    args = cmd.args
    if "run_dir" in args and cmd.config_dir is not None:
        raise ConfigError(
            "-cd: run_dir= predicts under the run's own config.yaml; -cd adds options for weights="
        )
    # the config's key (hydra.run.dir is refused as the Tool writes no run dir)
    if any(o.startswith("trainer.run_dir=") for o in cmd.overrides):
        raise ConfigError(
            "trainer.run_dir= places a training or evaluation run; a prediction's folder is "
            "out=<dir> (default: <run>/predict/<date>_<time>/): give out= instead"
        )
    settings = {
        field: _value(key, args[key], kind)
        for key, (field, kind) in SETTINGS.items()
        if key in args
    }
    step = args.get("step")
    ema = ["model.weights_ema=true"] if truth("ema", args.get("ema", "false")) else []
    cfg, base = prediction_job_config(
        args.get("run_dir"),
        args.get("weights"),
        None if step is None else step if step == "best" else _int("step", step),
        cmd.overrides + ema + (cmd.search if "weights" in args else []),
        settings,
        check_weights=not cmd.show,
    )
    if cmd.show:
        print(config_text(cfg, cmd.package))
        return 0
    predict_job(cfg, base)
    return 0


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value}: give a whole number") from None


def _value(key: str, text: str, kind):
    if kind is None:  # classes=a,b -> a list
        return [c.strip() for c in text.strip("[]").split(",") if c.strip()]
    if kind is int:
        return _int(key, text)
    if kind is bool:
        return truth(key, text)
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key}={text}: give a number") from None
    return text


def main(argv: list[str]) -> int:
    try:
        return cli_main(TOOL, CONFIGS, argv, predict)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # without the interpreter's teardown (visiondist.utils.exit)
