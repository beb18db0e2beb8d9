"""A tool's config: composed from configs/ (or a run's config.yaml), checked, its inputs looked at
before any rank starts; every problem one `ConfigError` line (the CLI and the sweeps both load
through here).

Every tool imports this module for its --help (0.2-0.35 s, no torch), which composes nothing:
Hydra (50 ms) and the continuing of a run (2 ms) are imported where a config is composed, the
planner and the input checks (20 ms) where a config is checked, the weights' own settings (5 ms)
where weights are read (`# noqa: PLC0415 (--help)`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    OmegaConfBaseException,
)

from visiondist.cli.errors import explain, grammar
from visiondist.config import (
    ConfigError,
    check_mandatory,
    compose,
    from_container,
    to_container,
)
from visiondist.config.compose import detection_data_for, flatten, run_config
from visiondist.config.schema import DETECTION_FORMATS, upgrade_saved
from visiondist.utils.data_defaults import apply_data_defaults
from visiondist.utils.logs import begin_job, say


def load_config(
    config_dir: Path, overrides: list[str], inputs: Optional[str] = "train"
) -> DictConfig:
    """Compose + validate, then check the inputs on disk for `inputs` ("train", "eval" or None:
    printing, planning); raises ConfigError with a one-line reason for any problem.

    Args:
        config_dir: configs/ (train.yaml and the groups).
        overrides: the command line's group=option / key=value overrides; a `trainer.run_dir` of
            a run continues it with its own config (`visiondist.runs`).
        inputs: what the inputs on disk are checked for: "train", "eval", or None (nothing read).

    Returns:
        The composed, validated config.
    """
    from hydra.errors import HydraException  # noqa: PLC0415 (--help)

    from visiondist.runs import continue_config, saved_config  # noqa: PLC0415 (--help)

    begin_job()
    try:
        cfg = compose(config_dir, overrides)
        pretrained = _pretrained_defaults(cfg, overrides)
        saved = saved_config(cfg)
        if saved is not None:  # trainer.run_dir=<a run>: continue it with its own config
            cfg = continue_config(cfg, upgrade_saved(saved), overrides)
        # what the ranks do: every key must be in the schema (`+key=` can add one)
        from_container(to_container(cfg))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(grammar(overrides) or explain(exc)) from exc
    _check_unread(cfg, overrides)
    cfg = checked(cfg, inputs)
    if saved is None and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        # a run's, not a printout's
        tuned = tuned_line(config_dir, cfg, overrides) if inputs is not None else None
        for line in (pretrained, tuned):
            if line:
                say(line) if inputs is not None else print(line, file=sys.stderr, flush=True)
    return cfg


# the keys only detection data reads (the images' folder and the annotation file under data.root)
DETECTION_KEYS = ("data.images", "data.annotations")


def _check_unread(cfg: DictConfig, overrides: list[str]) -> None:
    """A detection data key given for classification data would be ignored: refused in one line."""
    fmt = cfg.data.get("format")
    if fmt not in ("imagefolder", "shards"):
        return
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    for key in DETECTION_KEYS:
        if key in given:
            reads = "class folders (<root>/<split>/<class>/)" if fmt == "imagefolder" else "shards"
            raise ConfigError(
                f"{key}= is read by detection data (data=detection, data=coco); "
                f"data.format={fmt} reads {reads}: drop {key}"
            )


def tuned_line(config_dir: Path, cfg: DictConfig, overrides: list[str]) -> Optional[str]:
    """The settings `configs/tuned/<model>_<data>.yaml` gave this run (those the command line did
    not set), in one line, or None when there is no such file."""
    file = Path(config_dir) / "tuned" / f"{cfg.model.name}_{cfg.data.name}.yaml"
    if not file.is_file():
        return None
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    tree = OmegaConf.to_container(OmegaConf.load(file))
    shown = lambda value: "null" if value is None else str(value).replace(" ", "")  # noqa: E731 (as typed)
    kept = [
        f"{key}={shown(OmegaConf.select(cfg, key))}" for key in flatten(tree) if key not in given
    ]
    if not kept:
        return None
    return (
        f"configs/tuned/{file.name} sets {' '.join(kept)} (tuned for {cfg.model.name} on "
        f"{cfg.data.name}; any of them given wins)"
    )


def _pretrained_defaults(cfg: DictConfig, overrides: list[str]) -> Optional[str]:
    """A fine-tune from a timm name takes its data settings from the weights' pretrained config
    (unless given on the command line); the line that says so, or None."""
    try:
        return apply_data_defaults(cfg, overrides)
    except ValueError as exc:  # not a timm name timm knows: the same line validation gives
        raise ConfigError(str(exc)) from None


def load_weights_config(
    config_dir: Path, weights: Path, overrides: list[str], tool: str, data_needed: bool
) -> DictConfig:
    """The config of a tool's `weights=` (eval, predict): composed as `load_config` with
    `inputs=None`, after what the weights say of their model (`weights_settings`).

    Args:
        config_dir: configs/.
        weights: the weights file or from_pretrained directory.
        overrides: the command line's overrides (they win over the weights' own settings).
        tool: the tool's script name, for its messages ("eval.py").
        data_needed: the tool reads data (eval), so a from_pretrained directory's run must name it.

    Returns:
        The composed, validated config.
    """
    from visiondist.models.weights_check import weights_settings  # noqa: PLC0415 (--help)

    settings = weights_settings(weights, overrides, tool, data_needed)
    if not data_needed:
        settings += detection_data_for(config_dir, settings + overrides)
    return load_config(config_dir, settings + overrides, inputs=None)


def load_run_config(
    run_dir: Path, overrides: list[str], inputs: Optional[str] = "eval"
) -> DictConfig:
    """A finished run's resolved config.yaml with key=value overrides (no group switches), validated
    and its inputs checked for `inputs` (as `load_config`).

    Args:
        run_dir: the run's directory (its config.yaml, and layout.json for a `parallel=auto` run).
        overrides: key=value overrides only.
        inputs: what the inputs on disk are checked for ("eval", "train", or None).

    Returns:
        The run's config, validated.
    """
    # Hydra's +key= / ++key= (add a key) as tools/train.py takes them: a run's config takes new keys
    # where it takes them at all (model.kwargs)
    overrides = [o.lstrip("+") for o in overrides]
    bad = [o for o in overrides if "=" not in o or "." not in o.split("=", 1)[0]]
    groups = [o for o in bad if "=" in o]  # model=..., data=...: a config group switched
    if groups:
        raise ConfigError(
            f"{' '.join(groups)}: a run keeps its own {groups[0].split('=')[0]}; change keys "
            "within it (e.g. data.root=/path), or give weights=<file> "
            f"{groups[0]} instead of the run to use other weights"
        )
    if bad:
        raise ConfigError(
            f"{' '.join(bad)}: a run's config takes key=value overrides only (e.g. data.root=/path)"
        )
    try:
        cfg = run_config(run_dir, overrides)
    except OmegaConfBaseException as exc:
        raise ConfigError(explain(exc)) from exc
    return checked(cfg, inputs)


def _check_format(cfg: DictConfig) -> None:
    """data.format is one of the model's task's formats, before any folder is read for it: one line
    listing them (a detection format under a classifier's config reads the folder as the wrong
    kind of set and says nothing of the format)."""
    from visiondist.models.registry import TASKS  # noqa: PLC0415 (--help)

    fmt, family = cfg.data.get("format"), cfg.model.get("family")
    if fmt is None or family not in TASKS:
        return
    formats = {
        "classification": ("imagefolder", "shards"),
        "detection": (*DETECTION_FORMATS, "shards"),
    }[TASKS[family]]
    if fmt in formats:
        return
    if fmt in ("imagefolder", *DETECTION_FORMATS):
        task = TASKS[family]
        data_task = "detection" if fmt in DETECTION_FORMATS else "classification"
        model_eg = "fasterrcnn_mobilenet_v3" if data_task == "detection" else "vit_tiny"
        data_eg = (
            "data=detection for a YOLO, VOC or COCO set, data=shapes_coco for the built-in one"
            if task == "detection"
            else "data=imagenet for class folders, data=shapes for the built-in set"
        )
        raise ConfigError(
            f"data.format={fmt} is a format of {data_task} data, and model={cfg.model.name} is a "
            f"{task} model: give {task} data ({data_eg}; or data.format= one of "
            f"{', '.join(formats)}), or a {data_task} model (e.g. model={model_eg})"
        )
    raise ConfigError(
        f"data.format={fmt} is not a data format here: use one of {', '.join(formats)}"
    )


def _not_a_url(d: DictConfig) -> None:
    """A URL data.root is packed shards: refused under any other format before anything reads it
    (a built-in set would be generated into ./http:/..., a detection set reported missing)."""
    root = None if OmegaConf.is_missing(d, "root") else d.get("root")
    if isinstance(root, str) and "://" in root and d.get("format") != "shards":
        raise ConfigError(
            f"data.root={root}: a URL is read as packed shards (tools/data.py pack), not as "
            f"data.format={d.get('format')}: add data.format=shards"
        )


def _absolute_root(d: DictConfig) -> None:
    """A relative local `data.root` made absolute, as the run's config.yaml then records it: its
    evaluation, prediction or continuation from another directory reads the same data."""
    root = d.get("root")
    if OmegaConf.is_missing(d, "root") or not isinstance(root, str) or not root or "://" in root:
        return
    path = Path(root).expanduser()
    if not path.is_absolute() and path.exists():
        d.root = str(path.resolve())


def checked(cfg: DictConfig, inputs: Optional[str]) -> DictConfig:
    """Validate `cfg` and check its inputs on disk for `inputs` ("train", "eval"; None: nothing
    reads the data, so `???` values may stay unset). A `data.num_classes` left unset is counted from
    the data's classes first (the class folders of the train split), with one line saying so.

    Args:
        cfg: a composed config (changed in place where `data.num_classes` is counted).
        inputs: what its inputs are checked for: "train", "eval", or None.

    Returns:
        `cfg`, checked.
    """
    from visiondist.plan import check  # noqa: PLC0415 (--help)
    from visiondist.preflight import check_inputs, infer_num_classes  # noqa: PLC0415 (--help)

    if inputs is not None:  # the data is read (prediction reads none: its defaults stand)
        _check_format(cfg)
        _not_a_url(cfg.data)
        _absolute_root(cfg.data)
    # a packed built-in set is read from its shards, not generated
    if cfg.data.get("format") == "shards":
        cfg.data.synthetic = None
    unset = OmegaConf.is_missing(cfg.data, "num_classes")
    if inputs is not None and unset:  # any other `???` (data.root) first, in its own words
        check_mandatory(_with_classes(cfg, 1))
    recognised = None  # a user's detection data: its format read off the folder, YOLO / VOC indexed
    if inputs is not None and cfg.data.get("format") in ("auto", "yolo", "voc"):
        from visiondist.data.formats import resolve_detection  # noqa: PLC0415 (reader)

        recognised = resolve_detection(cfg.data, inputs)
        # the set's classes (a COCO file's are counted below, as data=coco's are)
        counted = not OmegaConf.is_missing(cfg.data, "num_classes")
        if counted and OmegaConf.is_missing(cfg.model, "num_classes"):
            cfg.model.num_classes = cfg.data.num_classes
    note = infer_num_classes(cfg, inputs)
    # printing, planning: still unknown, and nothing needs it
    if OmegaConf.is_missing(cfg.data, "num_classes"):
        check(_with_classes(cfg, 1), mandatory=False)
        return cfg
    check(cfg, mandatory=inputs is not None)  # no inputs read: a `???` data.root may stay unset
    if inputs is not None:
        check_inputs(cfg, inputs)
    # once per job, input all good
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        for line in (recognised, note):
            if line:
                say(line) if inputs is not None else print(line, file=sys.stderr, flush=True)
    return cfg


def _with_classes(cfg: DictConfig, num_classes: int) -> DictConfig:
    """A copy of `cfg` with an unset class count set (the model's follows the data's)."""
    copy = cfg.copy()
    copy.data.num_classes = num_classes
    if OmegaConf.is_missing(copy.model, "num_classes"):
        copy.model.num_classes = num_classes
    return copy
