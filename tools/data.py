"""Prepare data sets for training:

    python tools/data.py pack data=imagenet data.root=/data/imagenet out=/data/imagenet-shards
    python tools/data.py pack data=shapes out=/tmp/shapes-shards max_side=320 quality=90
    python tools/data.py convert data=detection data.root=/data/my_yolo to=coco out=/data/my_coco
    python tools/data.py split data=imagenet data.root=/data/my_photos val=0.1 out=/data/my_split

`pack` turns the train and val splits of an ImageFolder or COCO tree (data.root; a built-in set is
generated first) into WebDataset tar shards with an index (docs/data.md); train from them with
data.format=shards data.root=<out> (a directory, or the URL of a server that serves it).
`convert` writes the train and val splits of detection data (COCO, YOLO or VOC, recognised from the
folder; a built-in set) as COCO, YOLO or VOC (`visiondist.data.formats.convert`).
`split` cuts a val split from a set that has one split only: class folders (`data=imagenet`) into
train/ and val/ class folders, stratified; detection data (`data=detection`, an annotation tool's
export of one task, a YOLO set without `val:`) into a COCO (or `to=yolo|voc`) tree
(`visiondist.data.split`).
"""

import sys
from pathlib import Path

from visiondist.api.data_job import data_job
from visiondist.cli import Command, Tool, exit_now
from visiondist.cli import main as cli_main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOOL = Tool(
    name="data.py",
    about=(
        "Prepare data: `pack` writes the train and val splits of the data config's ImageFolder or "
        "COCO tree as WebDataset tar shards with an index, in parallel, resumable; train from "
        "them with data.format=shards. `convert` writes detection data (COCO, YOLO, VOC) as "
        "another of them. `split` cuts a val split from a set that has one split only (class "
        "folders, or a detection export of one task)."
    ),
    keys=(
        ("out=<dir>", "where the shards (convert, split: the written set) go (required)"),
        (
            "to=<coco|yolo|voc>",
            "convert: the format to write (required); split: detection's (default coco)",
        ),  # fmt: skip
        ("link=true", "convert, split: link the images instead of copying them"),
        (
            "val=<share>",
            "split: the share of each class's images (detection: of the images) for validation, "
            "e.g. val=0.1 (required)",
        ),
        ("seed=<n>", "split: which images go to val (default 0: the same split everywhere)"),
        (
            "shard_mb=<MB>",
            "source bytes per shard (default: 256, or a 64th of a smaller split: about 64 shards, "
            "fewer where a split has few images)",
        ),
        (
            "max_side=<px>",
            "re-encode every image as JPEG with its longer side at most this (default: the files "
            "as they are)",
        ),
        ("quality=<1-100>", "JPEG quality of re-encoded images (default 90)"),
        (
            "workers=<N>",
            "packing processes (default: every CPU this process may use: its affinity and "
            "container quota)",
        ),
        ("overwrite=true", "replace a finished pack in out="),
    ),
    reads="the data config's tree (data.root, data.train_split, data.val_split, "
    "data.annotations): pack an ImageFolder or COCO tree; convert and split (data=detection) "
    "any detection format, split (data=imagenet) class folders",
    writes="pack: <out>/<split>-NNNNNN.tar, <out>/<split>.json, <out>/<split>-index.npz, "
    "<out>/dataset.json; convert: the set in to='s format in out=; split: <out>/train/ and "
    "<out>/val/ (class folders; detection: COCO's annotations/instances_<split>.json, or to=)",
    on_stop="pack: the shards finished so far are kept, and the same command writes the rest; "
    "convert: what it wrote so far stays in out=, and the same command writes it again",
    examples=(
        "python tools/data.py pack data=imagenet data.root=/data/imagenet "
        "out=/data/imagenet-shards",
        "python tools/data.py pack data=imagenet data.root=/data/imagenet out=/data/imagenet-320 "
        "max_side=320",
        "python tools/data.py convert data=detection data.root=/data/my_yolo to=coco "
        "out=/data/my_coco",
        "python tools/data.py split data=imagenet data.root=/data/my_photos val=0.1 "
        "out=/data/my_split",
        "python tools/data.py split data=detection data.root=/data/label_studio_export val=0.2 "
        "out=/data/my_coco",
    ),
    run_dir=False,
    multirun=False,
    positional=True,
    command="pack|convert|split",
)


def run(cmd: Command) -> int:
    return data_job(cmd, CONFIGS)


def main(argv: list[str]) -> int:
    return cli_main(TOOL, CONFIGS, argv, run)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # without the interpreter's teardown (visiondist.utils.exit)
