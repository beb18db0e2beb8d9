"""The jobs of tools/data.py: `pack` (an ImageFolder or COCO tree as WebDataset shards with an
index, `data.shards.pack`), `convert` (detection data as COCO, YOLO or VOC, `data.formats.convert`)
and `split` (a val split cut from a set of one split, `data.split`), each printing what it wrote and
the command that trains from it.

The packers (torch, about 2 s) are imported when `pack` runs, not for `--help`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from PIL import Image

from visiondist.cli import Command, config_text, load_config
from visiondist.config import ConfigError
from visiondist.config.schema import DETECTION_FORMATS
from visiondist.data import coco_paths
from visiondist.data.formats import recognise, resolve_detection
from visiondist.data.formats.convert import TARGETS
from visiondist.data.formats.convert import convert as write
from visiondist.data.split import (
    check_fraction,
    check_out,
    class_folders,
    split_detection,
    split_image_folder,
)
from visiondist.observe.console import shown_path, tool_path
from visiondist.preflight.images import fitting_batch
from visiondist.synthetic import prepare_data


def _number(cmd: Command, key: str, kind, default):
    value = cmd.args.get(key)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{key}={value}: expected a {kind.__name__}") from None


def _with_a_model(overrides: list[str], configs: Path) -> list[str]:
    """Packing and converting read no model, but the config composes one: a detector's for
    detection data, unless named."""
    if any(o.startswith("model=") for o in overrides):
        return overrides
    data = next((o.split("=", 1)[1] for o in overrides if o.startswith("data=")), None)
    source = configs / "data" / f"{data}.yaml"
    formats = {f"format: {f}" for f in DETECTION_FORMATS}
    if data and source.is_file() and any(f in source.read_text() for f in formats):
        return [*overrides, "model=fasterrcnn_r50"]
    return overrides


def _data_config(cmd: Command, configs: Path) -> Optional[DictConfig]:
    """The command's data config (a detector's config where it names detection data); None where
    --cfg printed the config instead."""
    cfg = load_config(configs, _with_a_model(cmd.overrides, configs) + cmd.search, inputs=None)
    if cmd.show:
        print(config_text(cfg, cmd.package))
        return None
    return cfg.data


def _require_root(d: DictConfig) -> None:
    if OmegaConf.is_missing(d, "root"):
        raise ConfigError(
            f"data.root must be set (??? in the config): add data.root=/path/to/{d.name}"
        )


def data_job(cmd: Command, configs: Path) -> int:
    """tools/data.py's command (`pack`, `convert` or `split`) run; its exit code."""
    if cmd.paths == ["convert"]:
        return convert(cmd, configs)
    if cmd.paths == ["pack"]:
        return pack(cmd, configs)
    if cmd.paths == ["split"]:
        return split(cmd, configs)
    said = (
        f"`{' '.join(cmd.paths)}` is not a command of tools/data.py"
        if cmd.paths
        else "tools/data.py needs a command"
    )
    raise ConfigError(
        f"{said}: use pack (e.g. python tools/data.py pack data=imagenet "
        "data.root=/data/imagenet out=/data/shards), convert (e.g. python tools/data.py convert "
        "data=detection data.root=/data/my_yolo to=coco out=/data/my_coco) or split (e.g. python "
        "tools/data.py split data=imagenet data.root=/data/my_photos val=0.1 out=/data/my_split)"
    )


def convert(cmd: Command, configs: Path) -> int:

    target = cmd.args.get("to")
    if target not in TARGETS or "out" not in cmd.args:
        raise ConfigError(f"convert needs to=<{'|'.join(TARGETS)}> and out=<dir>")
    link = cmd.switch("link")
    d = _data_config(cmd, configs)
    if d is None:
        return 0
    if d.format not in DETECTION_FORMATS:
        raise ConfigError(f"data={d.name} is {d.format} data: convert writes detection data")
    _require_root(d)
    prepare_data(d, show_progress=sys.stderr.isatty())  # a built-in set: generated first
    if d.format in ("auto", "yolo", "voc"):  # recognised; YOLO and VOC indexed as COCO
        print(resolve_detection(d, "train"), flush=True)
    out = Path(cmd.args["out"]).expanduser()
    counts = write(d, target, out, link)
    for split, c in counts.items():
        left = [f"{n} {what}" for what, n in c.items() if n and what not in ("images", "objects")]
        more = f" ({'; '.join(left)})" if left else ""
        print(f"{split}: {c['images']} images, {c['objects']} objects written{more}")
    print(
        f"wrote {target} into {out}; train from it: python {_train_tool()} "
        f"data=detection data.root={_shown(out)} model=<detector>"
    )
    return 0


def split(cmd: Command, configs: Path) -> int:
    if "out" not in cmd.args or "val" not in cmd.args:
        raise ConfigError("split needs val=<share> and out=<dir>, e.g. val=0.1 out=/data/my_split")
    val, seed = _number(cmd, "val", float, None), _number(cmd, "seed", int, 0)
    check_fraction(val)
    d = _data_config(cmd, configs)
    if d is None:
        return 0
    _require_root(d)
    out = Path(cmd.args["out"]).expanduser()
    check_out(Path(d.root).expanduser(), out)
    if d.format in DETECTION_FORMATS:
        _split_detection(cmd, d, out, val, seed)
    else:
        _split_folders(cmd, d, out, val, seed)
    return 0


def _split_detection(cmd: Command, d: DictConfig, out: Path, val: float, seed: int) -> None:
    target = cmd.args.get("to", "coco")
    if target not in TARGETS:
        raise ConfigError(f"to={target}: split writes {' | '.join(TARGETS)}")
    d.val_split = d.train_split  # the one split read: the set's only one, or train
    print(resolve_detection(d, "eval"), flush=True)
    counts = split_detection(d, out, val, seed, cmd.switch("link"), target)
    for name, c in counts.items():
        print(f"{name}: {c['images']} images, {c['objects']} objects")
    print(
        f"wrote {target} into {out} ({d.val_split} cut {1 - val:.0%} / {val:.0%}, seed "
        f"{seed}); train from it: python {_train_tool()} data=detection "
        f"data.root={_shown(out)} model=<detector>"
    )


def _split_folders(cmd: Command, d: DictConfig, out: Path, val: float, seed: int) -> None:
    root = Path(d.root).expanduser()
    if d.format != "imagefolder":
        raise ConfigError(f"data={d.name} is {d.format} data: split reads class folders")
    if not root.is_dir():
        raise ConfigError(f"data.root={d.root}: no such directory")
    found = recognise(root)
    if found is not None:  # its images/ would read as one class
        raise ConfigError(
            f"data.root={d.root} is {found.what}, detection data: split it with data=detection"
        )
    source = class_folders(root, d.train_split)
    if (source / d.val_split).is_dir() or (root / d.val_split).is_dir():
        raise ConfigError(f"{root} already has a {d.val_split} split: train from it as it is")
    try:
        classes, unreadable = split_image_folder(source, out, val, seed, cmd.switch("link"))
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    train, held = (sum(c[k] for c in classes.values()) for k in ("train", "val"))
    print(
        f"{len(classes)} classes from {source}: train {train} images, val {held} "
        f"(val={val:g} of each class, rounded, at least 1; seed {seed}; train/val: "
        + ", ".join(f"{name} {c['train']}/{c['val']}" for name, c in list(classes.items())[:6])
        + (", ..." if len(classes) > 6 else "")
        + ")"
    )
    if unreadable:
        print(
            f"left out {len(unreadable)} image{'s' if len(unreadable) > 1 else ''} that cannot "
            "be read: "
            + "; ".join(f"{name} ({why})" for name, why in unreadable[:5])
            + ("; ..." if len(unreadable) > 5 else "")
        )
    print(
        f"wrote {out}/train and {out}/val; train from it: python {_train_tool()} "
        f"data=imagenet data.root={_shown(out)}{_fitting(d, train, out / 'train')}"
    )


# a small split's printed batch: at least this many steps an epoch, at most this batch
SPLIT_STEPS, SPLIT_BATCH = 4, 64


def _fitting(d: DictConfig, train: int, folder: Path) -> str:
    """The settings a split's printed train command adds for a small set: a global batch that
    gives each epoch a few steps (data=imagenet's 1024 is refused by a set smaller than it, and a
    batch of the whole set leaves one step an epoch), and an input size near the images' own
    where they are smaller than data.img_size (224 upscales an 80 x 64 photo 3x)."""
    out = ""
    if train < int(d.batch_size):
        out += f" data.batch_size={min(SPLIT_BATCH, fitting_batch(max(1, train // SPLIT_STEPS)))}"
    sides = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file())[:200]:
        try:
            with Image.open(path) as image:  # its header only
                sides.append(min(image.size))
        except (OSError, ValueError):
            continue
    if sides:
        median = sorted(sides)[len(sides) // 2]
        size = max(32, median // 16 * 16)  # whole patches of a /16 ViT
        if size < int(d.img_size):
            out += f" data.img_size={size}"
    return out


def pack(cmd: Command, configs: Path) -> int:
    # torch (2 s): not for --help
    from visiondist.data.shards.pack import (  # noqa: PLC0415 (a job's)
        PackError,
        PackOptions,
        pack_image_folder,
    )

    overwrite = cmd.switch("overwrite")
    d = _data_config(cmd, configs)
    if d is None:
        return 0
    _require_root(d)
    if d.format == "shards":
        raise ConfigError(
            "data.format=shards: pack reads an ImageFolder or COCO tree (leave data.format as "
            f"data={d.name} sets it)"
        )
    if "out" not in cmd.args:
        raise ConfigError("out=<dir> is required: where the shards go")
    options = PackOptions(
        shard_mb=_number(cmd, "shard_mb", float, None),
        max_side=_number(cmd, "max_side", int, None),
        quality=_number(cmd, "quality", int, 90),
        workers=_number(cmd, "workers", int, -1),
        overwrite=overwrite,
        progress=sys.stderr.isatty(),
    )
    if not 1 <= options.quality <= 100 or (options.shard_mb is not None and options.shard_mb <= 0):
        raise ConfigError("quality= is 1-100 and shard_mb= above 0")
    out = Path(cmd.args["out"]).expanduser()
    if (out / "dataset.json").is_file() and not options.overwrite:  # before any work
        raise ConfigError(
            f"{out} already holds a finished pack: add overwrite=true to replace it, or choose "
            "another out="
        )
    root = Path(d.root).expanduser()
    if d.synthetic is not None and not root.is_dir():
        print(f"generating the built-in {d.name} set in {root} first", flush=True)
    try:
        prepare_data(d, show_progress=sys.stderr.isatty())  # a built-in set: generated first
    except ValueError as exc:  # data.root holds another copy of it, or other files
        raise ConfigError(str(exc)) from None
    if not root.is_dir():
        raise ConfigError(f"data.root={d.root}: no such directory")
    try:
        if d.format in DETECTION_FORMATS:
            from visiondist.data.shards.packed_coco import pack_coco  # noqa: PLC0415 (a job's)

            meta = pack_coco(
                {s: coco_paths(d, s) for s in (d.train_split, d.val_split)}, out, options, root
            )
        else:
            meta = pack_image_folder(root, [d.train_split, d.val_split], out, options)
    # a split or annotation file missing
    except (PackError, FileNotFoundError, NotADirectoryError) as exc:
        raise ConfigError(str(exc)) from None
    for split, info in meta["splits"].items():
        print(
            f"{split}: {info['samples']} samples in {info['shards']} "
            f"shard{'' if info['shards'] == 1 else 's'}, {info['bytes'] / 1e6:.1f} MB"
        )
    detection = meta.get("kind") == "detection"
    # the default model is a classifier: a detection pack's command names a detector
    given = any(o.lstrip("+").startswith("model=") for o in cmd.overrides)
    model = [o for o in cmd.overrides if o.lstrip("+").startswith("model=")][-1:] if given else []
    if detection and not given:
        model = ["model=fasterrcnn_mobilenet_v3"]
    print(
        f"{len(meta['classes'])} {'categories' if detection else 'classes'}; train from it: "
        f"python {' '.join([_train_tool(), *model])} data={d.name} data.format=shards "
        f"data.root={_shown(out)}"
    )
    return 0


def _train_tool() -> str:
    """tools/train.py as the other tools print it: typed from here."""
    return tool_path("train")


def _shown(path) -> str:
    """`path` as typed from here, whole where it is outside the working directory."""
    return shown_path(Path(path).resolve())
