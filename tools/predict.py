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
    load_run_config,
    load_weights_config,
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
            "weights=<path>",
            "weights as tools/eval.py takes them (a .safetensors or torch file, a checkpoint, a "
            "from_pretrained directory), under the config of group=option / group.key=value",
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
)


def predict(cmd: Command) -> int:
    from omegaconf import OmegaConf

    from visiondist.inference.job import run_weights
    from visiondist.inference.sources import resolve_source

    args = cmd.args
    if ("run_dir" in args) == ("weights" in args):
        raise ConfigError(
            "give run_dir=<run> (a training run) or weights=<file> with model=... data=...: --help "
            "shows both"
        )
    if "step" in args and "run_dir" not in args:
        raise ConfigError(f"step={args['step']} picks a checkpoint of a run: add run_dir=<run>")
    if "run_dir" in args:
        if cmd.config_dir is not None:
            raise ConfigError(
                "-cd: run_dir= predicts under the run's own config.yaml; -cd adds options for "
                "weights="
            )
        base = Path(args["run_dir"]).expanduser()
        cfg = load_run_config(base, cmd.overrides, inputs=None)
        step = args.get("step")
        weights = run_weights(
            base, None if step is None else step if step == "best" else _int("step", step)
        )
    else:
        base, weights = None, Path(args["weights"]).expanduser()
        if not weights.exists():
            raise ConfigError(f"weights={args['weights']}: no such file or checkpoint directory")
        cfg = load_weights_config(
            CONFIGS, weights, cmd.overrides + cmd.search, "predict.py", data_needed=False
        )
        if not cmd.show:  # --cfg prints the config without reading the weights
            _check_weights(cfg, weights)
    settings = {
        field: _value(key, args[key], kind)
        for key, (field, kind) in SETTINGS.items()
        if key in args
    }
    data = {}
    if base is None:  # an export: the run's own eval preprocessing, as its sidecar recorded it
        from visiondist.inference.job import recorded_preprocessing

        data = recorded_preprocessing(weights)
        if data:
            print(
                f"preprocessing as {weights.with_suffix('.json').name} records the run's: "
                + " ".join(f"data.{k}={v}" for k, v in data.items()),
                flush=True,
            )
    # one model a rank: prediction shards the images, never the model (whatever layout trained it)
    cfg = OmegaConf.merge(
        cfg,
        {
            "predict": settings,
            "data": data,
            "model": {"weights": str(weights.resolve()), "init_from": None},
            "parallel": {
                "name": "ddp",
                "dp": -1,
                "tp": 1,
                "pp": 1,
                "sequence_parallel": False,
                "fsdp": False,
                "offload": False,
                "auto": False,
                "activation_checkpointing": False,
            },
        },
    )
    if cmd.show:
        print(config_text(cfg, cmd.package))
        return 0
    p = cfg.predict
    if p.topk < 1 or p.max_det < 1 or not 0 <= p.score_thresh <= 1 or p.batch_size < 0:
        raise ConfigError(
            "topk and max_det take 1 or more, score_thresh a score in [0, 1], batch 1 or more"
        )
    if str(p.save_images).lower() != "all" and not str(p.save_images).isdigit():
        raise ConfigError(f"save_images={p.save_images}: give a count (0: none) or all")
    # a missing or empty source: refused here, in one line
    source = resolve_source(p.source, int(p.vid_stride))
    from visiondist.inference.model import read_names
    from visiondist.inference.run import check_classes

    names = read_names(cfg)
    if p.classes:
        # a classifier's, or classes the detector was not trained for: refused here
        check_classes(cfg, names)
    out, state = _choose_out(cfg, base, source)
    if state == "complete":
        print(
            f"complete: {out} already holds this prediction (predict.json); give out=<dir> to "
            "predict again",
            flush=True,
        )
        return 0
    if out is not None:
        cfg.trainer.run_dir = str(out)
        cfg.trainer.resume = "auto"  # an earlier attempt's directory is continued, not refused
        if state == "running":
            print(f"continuing the prediction in {out}", flush=True)
    else:
        cfg.trainer.run_dir = None
        cfg.trainer.output_dir = str(base) if base is not None else cfg.trainer.output_dir
    from visiondist.inference.run import predict_ranks
    from visiondist.launch import launch

    launch(predict_ranks, cfg)
    return 0


def _check_weights(cfg, weights: Path) -> None:
    """The file against the model, before anything is printed or any rank starts (as tools/eval.py
    does): an export's graph or program, a file of another model, is refused in one line naming this
    tool's key."""
    from omegaconf import OmegaConf

    from visiondist.models.weights_check import check_weights

    model = OmegaConf.merge(cfg.model, {"weights": str(weights.resolve())})
    try:
        check_weights(model, "eval", OmegaConf.select(cfg, "data.num_classes", default=None))
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("model.weights=", "weights=")) from None


def _choose_out(cfg, base, source):
    """(the directory, its state: new | running | complete) of this prediction: out=, or the newest
    earlier attempt of the same request under <run>/predict/ (a stopped one is continued); (None,
    "new") for a new default dir."""
    from visiondist.inference.job import request
    from visiondist.inference.outputs import read_manifest

    ask = request(cfg, source)
    if cfg.predict.out:
        out = Path(cfg.predict.out).expanduser().resolve()
        manifest = read_manifest(out)
        if manifest is None:
            if out.is_dir() and any(out.iterdir()):
                raise ConfigError(
                    f"out={cfg.predict.out} is a folder that holds no prediction: give a new or "
                    "empty folder"
                )
            return out, "new"
        if manifest.get("request") != ask:
            other = manifest.get("request", {}).get("source")
            raise ConfigError(
                f"out={cfg.predict.out} holds a prediction of {other} with other weights or "
                "settings: give another out=, or remove that folder"
            )
        return out, manifest.get("state", "running")
    parent = (base if base is not None else Path(cfg.trainer.output_dir).expanduser()) / "predict"
    earlier = (
        sorted((d for d in parent.iterdir() if d.is_dir()), reverse=True) if parent.is_dir() else []
    )
    for folder in earlier:
        manifest = read_manifest(folder)
        if manifest is not None and manifest.get("request") == ask:
            return folder.resolve(), manifest.get("state", "running")
    return None, "new"


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
        if text.strip().lower() not in ("true", "false"):
            raise ConfigError(f"{key}={text}: give true or false")
        return text.strip().lower() == "true"
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
