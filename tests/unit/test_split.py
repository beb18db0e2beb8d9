"""`tools/data.py split`: a val split cut from a set of one split. Class folders are split per class
(every class in both splits, none lost, none in both, the same split for the same seed); a detection
export of one task is split by image with its objects, and the written tree reads as a set of two
splits with the source's classes."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
from helpers import REPO
from omegaconf import OmegaConf
from PIL import Image

from visiondist.data.formats import resolve_detection


def _tool():
    spec = importlib.util.spec_from_file_location(
        "data_tool_under_test", REPO / "tools" / "data.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _classes(root: Path, counts: dict[str, int]) -> Path:
    for name, n in counts.items():
        for i in range(n):
            path = root / name / f"{i:02d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (16, 16), (10 * i, 0, 0)).save(path)
    return root


def _tree(root: Path) -> dict[str, set[str]]:
    return {
        split: {p.relative_to(root / split).as_posix() for p in (root / split).rglob("*.jpg")}
        for split in ("train", "val")
    }


def test_class_folders_are_split_per_class_and_the_same_seed_gives_the_same_split(tmp_path, capsys):
    photos = _classes(tmp_path / "photos", {"cat": 10, "dog": 5, "owl": 2})
    (photos / "cat" / "broken.jpg").write_bytes(b"")  # left out, named
    args = ["split", "data=imagenet", f"data.root={photos}", "val=0.2"]
    assert _tool().main([*args, f"out={tmp_path / 'a'}"]) == 0
    out = capsys.readouterr().out
    assert "3 classes from" in out and "train 13 images, val 4" in out
    assert "left out 1 image that cannot be read: cat/broken.jpg (the file is empty)" in out
    # 13 training images of 16 px, under data=imagenet's global batch of 1024 and its 224 px: the
    # command that trains them names a batch giving each epoch a few steps (13 // 4 -> 2) and the
    # smallest input size (32: two patches a side)
    assert (
        f"train from it: python tools/train.py data=imagenet data.root={tmp_path / 'a'} "
        "data.batch_size=2 data.img_size=32\n" in out
    )
    a = _tree(tmp_path / "a")
    # 20% of 10, of 5 (one), of 2 (at least one: every class in both splits)
    held = {name: sum(p.startswith(f"{name}/") for p in a["val"]) for name in ("cat", "dog", "owl")}
    assert held == {"cat": 2, "dog": 1, "owl": 1}
    (photos / "cat" / "broken.jpg").unlink()
    everything = {p.relative_to(photos).as_posix() for p in photos.rglob("*.jpg")}
    assert a["train"] | a["val"] == everything and not a["train"] & a["val"]
    assert _tool().main([*args, f"out={tmp_path / 'b'}"]) == 0
    assert _tree(tmp_path / "b") == a  # the same seed: the same split
    assert _tool().main([*args, "seed=1", f"out={tmp_path / 'c'}"]) == 0
    assert _tree(tmp_path / "c")["val"] != a["val"]
    # copies, unless link=true
    assert not any(p.is_symlink() for p in (tmp_path / "a").rglob("*.jpg"))
    assert _tool().main([*args, "link=true", f"out={tmp_path / 'd'}"]) == 0
    assert all(p.is_symlink() for p in (tmp_path / "d").rglob("*.jpg"))


def test_a_train_only_tree_is_split_and_bad_requests_are_one_line(tmp_path, capsys):
    root = tmp_path / "set"
    _classes(root / "train", {"a": 4, "b": 4})
    assert _tool().main(["split", "data=imagenet", f"data.root={root}", "val=0.25",
                         f"out={tmp_path / 'out'}"]) == 0  # fmt: skip
    assert {k: len(v) for k, v in _tree(tmp_path / "out").items()} == {"train": 6, "val": 2}
    capsys.readouterr()
    (root / "val").mkdir()
    one = _classes(tmp_path / "one", {"a": 3, "b": 1})
    detection = tmp_path / "det"
    _made(detection / "annotations" / "instances_default.json").write_text(
        json.dumps({"images": [], "annotations": [], "categories": [{"id": 1, "name": "a"}]})
    )
    (detection / "images").mkdir()
    for args, says in (
        ([f"data.root={root}", "val=0.25", f"out={tmp_path / 'x'}"], "already has a val split"),
        ([f"data.root={root}", "val=1.5", f"out={tmp_path / 'x'}"], "between 0 and 1"),
        ([f"data.root={root}", "val=0.2", f"out={tmp_path / 'out'}"], "is not empty"),
        ([f"data.root={root}", f"out={tmp_path / 'x'}"], "split needs val=<share> and out=<dir>"),
        ([f"data.root={root}", "val=0.2", f"out={root / 'split'}"], "is inside data.root"),
        (
            [f"data.root={one}", "val=0.2", f"out={tmp_path / 'y'}"],
            "b (1): a class needs 2 images or more to be in both splits",
        ),
        (
            [f"data.root={detection}", "val=0.2", f"out={tmp_path / 'z'}"],
            "detection data: split it with data=detection",
        ),
    ):
        assert _tool().main(["split", "data=imagenet", *args]) == 2
        assert says in capsys.readouterr().err


def test_a_detection_export_of_one_task_is_split_by_image_with_its_objects(tmp_path, capsys):
    """CVAT's instances_default.json (one task, no subsets) of 10 images: 3 go to val with their
    boxes; the written COCO tree trains with the same classes."""
    root = tmp_path / "cvat"
    images, annotations = [], []
    for i in range(10):
        Image.new("RGB", (40, 30)).save(_made(root / "images" / f"{i}.jpg"))
        images.append({"id": i + 1, "file_name": f"{i}.jpg", "width": 40, "height": 30})
        annotations += [
            {"id": 2 * i + k, "image_id": i + 1, "category_id": 1 + k, "bbox": [1, 2, 10, 8],
             "area": 80, "iscrowd": 0}
            for k in range(2)
        ]  # fmt: skip
    categories = [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}]
    _made(root / "annotations" / "instances_default.json").write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": categories})
    )
    out = tmp_path / "split"
    assert _tool().main(["split", "data=detection", f"data.root={root}", "val=0.3",
                         f"out={out}"]) == 0  # fmt: skip
    said = capsys.readouterr().out
    assert "train: 7 images, 14 objects" in said and "val: 3 images, 6 objects" in said
    parts = {
        s: json.loads((out / "annotations" / f"instances_{s}.json").read_text())
        for s in ("train", "val")
    }
    ids = {s: {i["id"] for i in c["images"]} for s, c in parts.items()}
    assert not ids["train"] & ids["val"] and len(ids["train"] | ids["val"]) == 10
    for s, coco in parts.items():
        assert {a["image_id"] for a in coco["annotations"]} == ids[s]
        assert coco["categories"] == categories
        assert all((out / s / i["file_name"]).is_file() for i in coco["images"])
    d = _data(out)
    assert "train 7 images, 14 boxes; val 3 images, 6 boxes" in resolve_detection(d, "train")


def _data(root: Path):
    """data=detection's keys the resolver fills, on `root`."""
    return OmegaConf.create(
        {"name": "detection", "format": "auto", "root": str(root), "train_split": "train",
         "val_split": "val", "num_classes": "???", "images": "{split}", "annotations": "x",
         "found": None}
    )  # fmt: skip


def _made(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.parametrize("target", ["yolo", "voc"])
def test_a_detection_split_may_be_written_as_yolo_or_voc(tmp_path, target, capsys):
    root = tmp_path / "one"
    for i in range(4):
        Image.new("RGB", (40, 30)).save(_made(root / "images" / "train" / f"{i}.jpg"))
        _made(root / "labels" / "train" / f"{i}.txt").write_text("0 0.5 0.5 0.25 0.5\n")
    (root / "data.yaml").write_text("path: .\ntrain: images/train\nnames: [thing]\n")
    out = tmp_path / target
    assert _tool().main(["split", "data=detection", f"data.root={root}", "val=0.25",
                         f"to={target}", f"out={out}"]) == 0  # fmt: skip
    assert "train: 3 images, 3 objects" in capsys.readouterr().out
    d = _data(out)
    assert "train 3 images, 3 boxes; val 1 image, 1 box" in resolve_detection(d, "train")


def test_training_and_evaluating_on_one_split_is_warned_of(tmp_path, caplog):
    """data.train_split=data.val_split (a set of one split read twice): the evaluations would score
    the training images; the launch says so and names split."""
    from visiondist.cli import load_config

    root = tmp_path / "set"
    _classes(root / "train", {"a": 4, "b": 4})
    with caplog.at_level("WARNING"):
        load_config(
            REPO / "configs",
            ["data=imagenet", f"data.root={root}", "data.val_split=train", "data.batch_size=4"],
        )
    assert (
        "data.train_split and data.val_split are both train: the evaluations score the "
        in (caplog.text)
        and f"python tools/data.py split data=imagenet data.root={root} val=0.1" in caplog.text
    )


def test_a_classification_launch_names_the_folder_that_holds_the_splits(tmp_path):
    """data=imagenet pointed one folder too deep (at train/), at a detection export, or at a set of
    one class: one line naming what to give."""
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    split = tmp_path / "split"
    for s in ("train", "val"):
        _classes(split / s, {"a": 2, "b": 2})
    one = _classes(tmp_path / "one", {"a": 2})
    _classes(tmp_path / "single" / "train", {"a": 2})
    _classes(tmp_path / "single" / "val", {"a": 2})
    export = tmp_path / "ls"
    (export / "images").mkdir(parents=True)
    (export / "result.json").write_text(
        json.dumps({"images": [], "annotations": [], "categories": []})
    )
    itself = (
        f"is the train split itself: give the folder that holds train and val, data.root={split}"
    )
    for root, says in (
        (split / "train", itself),
        (
            export,
            "is COCO in Label Studio's layout, not class folders: read it with data=detection",
        ),
        (tmp_path / "single", "has one class folder: a classifier of one class learns nothing"),
        (one, "has no train split"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(REPO / "configs", ["data=imagenet", f"data.root={root}"])
