"""A user's detection data as it comes (visiondist.data.formats): YOLO folders, Pascal VOC and
tools' COCO layouts recognised from the folder, indexed as COCO ground truth, their bad labels
named, the index cached, and one format written from another with the same ground truth back."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from visiondist.config import ConfigError
from visiondist.data.formats import recognise, resolve_detection
from visiondist.data.formats.convert import write_coco, write_voc, write_yolo
from visiondist.data.formats.yolo import label_path, parse_line

NAMES = ["cat", "dog", "bird"]


def _image(path: Path, size=(64, 48), color=(120, 30, 200)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path, quality=95)


def _yolo(root: Path, labels: dict[str, dict[str, str]], names=NAMES, size=(64, 48)) -> Path:
    """A YOLO set: `labels[split][stem]` is that image's label file (None: no file)."""
    for split, files in labels.items():
        for stem, text in files.items():
            _image(root / "images" / split / f"{stem}.jpg", size)
            if text is not None:
                path = root / "labels" / split / f"{stem}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    spec = {"path": ".", **{s: f"images/{s}" for s in labels}, "names": names}
    (root / "data.yaml").write_text(json.dumps(spec))  # JSON is YAML
    return root


def _data(root: Path, fmt: str = "auto", **more) -> OmegaConf:
    return OmegaConf.create(
        {
            "name": "detection",
            "format": fmt,
            "root": str(root),
            "train_split": "train",
            "val_split": "val",
            "num_classes": "???",
            # fmt: skip
            "images": "{split}",
            "annotations": "x",
            "found": None,
            **more,
        }
    )


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _gt(d, split: str) -> dict:
    return json.loads(Path(d.annotations.format(split=split)).read_text())


# -- YOLO ------------------------------------------------------------------------------------------


def test_a_yolo_set_is_indexed_as_coco_with_pixel_boxes_and_polygons(tmp_path):
    root = _yolo(tmp_path / "set", {
        "train": {"a": "0 0.5 0.5 0.5 0.5\n2 0.25 0.25 0.5 0.5 0.5 0.75\n", "b": None, "c": ""},
        "val": {"d": "1 0.25 0.5 0.25 0.5\n"},
    })  # fmt: skip
    d = _data(root)
    line = resolve_detection(d, "train")
    assert "a YOLO set (data.yaml), 3 classes" in line and "train 3 images, 2 boxes" in line
    assert "2 images without labels" in line  # b (no file) and c (empty)
    assert d.num_classes == 3 and d.found == "yolo" and Path(d.images) == root / "images"
    gt = _gt(d, "train")
    assert [c["name"] for c in gt["categories"]] == NAMES and [
        c["id"] for c in gt["categories"]
    ] == [1, 2, 3]
    assert [i["file_name"] for i in gt["images"]] == ["train/a.jpg", "train/b.jpg", "train/c.jpg"]
    assert {(i["width"], i["height"]) for i in gt["images"]} == {(64, 48)}
    box, poly = gt["annotations"]
    assert box["bbox"] == [16.0, 12.0, 32.0, 24.0] and box["category_id"] == 1
    assert poly["category_id"] == 3 and poly["segmentation"] == [
        [16.0, 12.0, 32.0, 24.0, 32.0, 36.0]
    ]
    assert poly["bbox"] == [16.0, 12.0, 16.0, 24.0] and poly["area"] == 96.0  # the triangle's
    assert _gt(d, "val")["annotations"][0]["bbox"] == [8.0, 12.0, 16.0, 24.0]


def test_yaml_names_as_a_dict_relative_paths_and_a_txt_list(tmp_path):
    root = tmp_path / "set"
    for stem in ("a", "b"):
        _image(root / "images" / "all" / f"{stem}.jpg")
        (root / "labels" / "all").mkdir(parents=True, exist_ok=True)
        (root / "labels" / "all" / f"{stem}.txt").write_text("1 0.5 0.5 0.2 0.2\n")
    (root / "train.txt").write_text("./images/all/a.jpg\n")
    (root / "val.txt").write_text("./images/all/b.jpg\n")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "data.yaml").write_text(
        f"path: {root}\ntrain: train.txt\nval: val.txt\nnames:\n  0: x\n  1: y\n"
    )
    d = _data(tmp_path / "cfg" / "data.yaml")
    resolve_detection(d, "train")
    assert d.num_classes == 2 and [i["file_name"] for i in _gt(d, "val")["images"]] == ["b.jpg"]


def test_a_roboflow_yolo_export_s_parent_relative_splits_are_read_as_ultralytics_reads_them(
    tmp_path,
):
    """Roboflow's YOLO export: data.yaml at the top, `train: ../train/images`, no `path:`; a path
    that is not there is read without its ../, as Ultralytics does."""
    root = tmp_path / "rf"
    for folder in ("train", "valid"):
        _image(root / folder / "images" / "a.jpg")
        (root / folder / "labels").mkdir(parents=True)
        (root / folder / "labels" / "a.txt").write_text("0 0.5 0.5 0.25 0.25\n")
    (root / "data.yaml").write_text(
        "train: ../train/images\nval: ../valid/images\nnc: 1\nnames: ['thing']\n"
    )
    d = _data(root)
    resolve_detection(d, "train")
    assert d.num_classes == 1 and _gt(d, "val")["annotations"][0]["bbox"] == [
        24.0,
        18.0,
        16.0,
        12.0,
    ]
    (root / "data.yaml").write_text(
        "train: ../elsewhere/images\nval: ../valid/images\nnames: [a]\n"
    )
    with pytest.raises(ConfigError, match=r"read from the data.yaml's folder, .*rf\)"):
        resolve_detection(_data(root), "train")


def test_a_missing_split_the_job_does_not_read_is_a_warning(tmp_path, caplog):
    """Roboflow writes `test: ../test/images` without exporting a test split: training (train and
    val) goes on with one warning; a job that reads the missing split is refused."""
    root = _yolo(tmp_path / "rf", {"train": {"a": "0 0.5 0.5 0.2 0.2\n"}, "val": {"b": ""}})
    spec = json.loads((root / "data.yaml").read_text())
    (root / "data.yaml").write_text(json.dumps({**spec, "test": "../test/images"}))
    with caplog.at_level("WARNING"):
        resolve_detection(_data(root), "train")
    assert (
        "test: " in caplog.text
        and "does not exist: not read (this job reads train and val)" in (caplog.text)
    )
    with pytest.raises(ConfigError, match=r"test: .*test/images does not exist: fix `test:`"):
        resolve_detection(_data(root, val_split="test"), "eval")


def test_label_lines_checked_as_ultralytics_reads_them():
    assert parse_line("0 0.5 0.5 0.2 0.2", 3).box == pytest.approx((0.4, 0.4, 0.6, 0.6))
    edge = parse_line("0 0.0995 0.5 0.2 0.2", 3)  # reaches -0.0005: rounding, clipped
    assert edge.clipped and edge.box[0] == 0.0
    # a box past the edge (its fields in [0, 1]): clipped to the image, as the same box in COCO
    past = parse_line("0 0.99 0.5 0.028 0.2", 3)
    assert past.clipped and past.box == pytest.approx((0.976, 0.4, 1.0, 0.6))
    for text, why in (
        ("3 0.5 0.5 0.2 0.2", "class 3 is not one of names' 0..2"),
        ("0 0.5 0.5 0.2", "4 fields"),
        ("0 0.5 0.5 0.2 0.2 0.1", "6 fields"),
        ("0 0.5 0.5 nan 0.2", "not a finite number"),
        ("0 12 30 40 50", r"outside \[0, 1\]"),
        ("0 0.5 0.5 0 0.2", "zero width or height"),
        ("a 0.5 0.5 0.2 0.2", "not a number"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_line(text, 3)
    assert label_path(Path("/d/images/train/images/x.png")) == Path("/d/images/train/labels/x.txt")


def test_bad_val_labels_are_refused_naming_file_and_line(tmp_path):
    root = _yolo(
        tmp_path / "set",
        {
            "train": {"a": "0 0.5 0.5 0.5 0.5\n"},
            # fmt: skip
            "val": {"v": "0 0.5 0.5 0.5 0.5\n0 1.5 0.5 0.5 0.5\n"},
        },
    )
    with pytest.raises(ConfigError) as err:
        resolve_detection(_data(root), "train")
    assert f"{root / 'labels' / 'val' / 'v.txt'}:2: a coordinate is outside [0, 1]" in str(
        err.value
    )


def test_bad_train_labels_are_left_out_counted_and_named(tmp_path, caplog):
    root = _yolo(tmp_path / "set", {
        "train": {"a": "0 0.5 0.5 0.5 0.5\n0 0.5 0.5 0 0.2\n1 0.5 0.5\n", "b": "1 0.5 0.5 0.4 "
                                                                               "0.4\n"},
        "val": {"v": "0 0.5 0.5 0.5 0.5\n"},
    })  # fmt: skip
    (root / "labels" / "train" / "gone.txt").write_text("0 0.5 0.5 0.5 0.5\n")  # no image
    d = _data(root)
    with caplog.at_level(logging.WARNING):
        line = resolve_detection(d, "train")
    assert "2 bad label lines" in line and "1 label file without an image" in line
    named = caplog.text
    assert f"{root / 'labels/train/a.txt'}:2: the box has zero width or height" in named
    assert f"{root / 'labels/train/a.txt'}:3: 3 fields" in named
    assert f"{root / 'labels/train/gone.txt'}: a label file without an image" in named
    assert len(_gt(d, "train")["annotations"]) == 2  # a's first line and b's


def test_a_label_written_twice_is_one_object_counted(tmp_path):
    """A label file whose lines were appended twice (`cat f f > f`): each object once, as
    Ultralytics keeps them; twice the val ground truth would have halved the scores. The same box
    in another class, and a VOC object listed twice, likewise."""
    twice = "0 0.5 0.5 0.5 0.5\n1 0.25 0.5 0.25 0.5\n" * 2 + "1 0.5 0.5 0.5 0.5\n"
    root = _yolo(tmp_path / "set", {"train": {"a": twice}, "val": {"v": twice}})
    d = _data(root)
    line = resolve_detection(d, "val")
    assert "val 1 image, 3 boxes (2 duplicates left out)" in line, line
    assert [(a["category_id"], a["bbox"]) for a in _gt(d, "val")["annotations"]] == [
        (1, [16.0, 12.0, 32.0, 24.0]),
        (2, [8.0, 12.0, 16.0, 24.0]),
        (2, [16.0, 12.0, 32.0, 24.0]),
    ]
    voc = tmp_path / "voc"
    _voc_file(voc, "a", _voc_object("dog", (11, 11, 30, 40)) * 2)
    (voc / "ImageSets" / "Main").mkdir(parents=True)
    for split in ("train", "val"):
        (voc / "ImageSets" / "Main" / f"{split}.txt").write_text("a\n")
    d = _data(voc)
    assert "1 duplicate left out" in resolve_detection(d, "val")
    assert len(_gt(d, "val")["annotations"]) == 1


def test_a_detector_evaluated_on_its_classes_in_another_order_is_told_where_the_order_lives(
    tmp_path,
):
    """Weights trained with names [cat, dog, bird] on a YOLO copy whose data.yaml lists them in
    another order: refused, naming where each format takes its order from."""
    from safetensors.torch import save_file

    from visiondist.inference.names import check_same_classes

    root = _yolo(tmp_path / "set", {"train": {"a": "0 0.5 0.5 0.5 0.5\n"},
                                    "val": {"v": "0 0.5 0.5 0.5 0.5\n"}},
                 names=["dog", "cat", "bird"])  # fmt: skip
    d = _data(root)
    resolve_detection(d, "val")
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(1)}, str(weights), metadata={"classes": json.dumps(NAMES)})
    cfg = OmegaConf.create({"model": {"family": "torchvision", "weights": str(weights)}, "data": d})
    with pytest.raises(
        ConfigError,
        match=rf"trained on classes cat, dog, bird, but the annotations of {root} holds the same "
        r"classes in another order: list them in the trained order \(a YOLO set's data.yaml",
    ):
        check_same_classes(cfg)


def test_names_shorter_than_the_labels_use_is_one_line(tmp_path):
    root = _yolo(tmp_path / "set", {"train": {"a": "5 0.5 0.5 0.5 0.5\n"},
                                    "val": {"v": "0 0.5 0.5 0.5 0.5\n"}})  # fmt: skip
    with pytest.raises(
        ConfigError,
        match=r"names lists 3 classes but 1 label line of the train "
        r"split uses a class outside them .*add the missing names",
    ):
        resolve_detection(_data(root), "train")


def test_a_yaml_naming_a_missing_folder_is_one_line(tmp_path):
    root = tmp_path / "set"
    root.mkdir()
    (root / "data.yaml").write_text("path: .\ntrain: images/train\nval: images/val\nnames: [a]\n")
    with pytest.raises(ConfigError, match=r"train: .*images/train does not exist: fix `train:`"):
        resolve_detection(_data(root), "train")
    # a path: written on another machine: that is the key to fix
    (root / "data.yaml").write_text(
        "path: /home/me/datasets/set\ntrain: images/train\nval: images/val\nnames: [a]\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"path: /home/me/datasets/set does not exist: fix `path:`, or remove it to read the "
        rf"splits from the yaml's folder, {root}$",
    ):
        resolve_detection(_data(root), "train")


def test_an_unreadable_image_is_named(tmp_path):
    root = _yolo(tmp_path / "set", {"train": {"a": "0 0.5 0.5 0.5 0.5\n"},
                                    "val": {"v": "0 0.5 0.5 0.5 0.5\n"}})  # fmt: skip
    (root / "images" / "val" / "v.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ConfigError, match=r"v\.jpg: unreadable image"):
        resolve_detection(_data(root), "train")


def test_the_index_is_reused_until_a_file_changes(tmp_path, monkeypatch):
    from visiondist.data.formats import labels

    root = _yolo(tmp_path / "set", {"train": {"a": "0 0.5 0.5 0.5 0.5\n"},
                                    "val": {"v": "0 0.5 0.5 0.5 0.5\n"}})  # fmt: skip
    built = []
    original = labels.index_yolo
    monkeypatch.setattr("visiondist.data.formats.resolve.index_yolo",
                        lambda *a: built.append(a[1]) or original(*a))  # fmt: skip
    resolve_detection(_data(root), "train")
    resolve_detection(_data(root), "train")
    assert built == ["train", "val"]  # the second time, from the cache
    label = root / "labels" / "train" / "a.txt"
    label.write_text("1 0.5 0.5 0.5 0.5\n")
    os.utime(label, ns=(1, 1))  # a change the same second still changes the file's time
    d = _data(root)
    resolve_detection(d, "train")
    assert (
        built == ["train", "val", "train"] and _gt(d, "train")["annotations"][0]["category_id"] == 2
    )


# -- VOC -------------------------------------------------------------------------------------------


def _voc_file(
    root: Path, stem: str, objects: str, size="<size><width>64</width><height>48</height></size>"
):
    (root / "Annotations").mkdir(parents=True, exist_ok=True)
    _image(root / "JPEGImages" / f"{stem}.jpg")
    (root / "Annotations" / f"{stem}.xml").write_text(
        f"<annotation><filename>{stem}.jpg</filename>{size}{objects}</annotation>"
    )


def _voc_object(name: str, box: tuple, difficult: int = 0) -> str:
    corners = "".join(f"<{k}>{v}</{k}>" for k, v in zip(("xmin", "ymin", "xmax", "ymax"), box))
    return (
        f"<object><name>{name}</name><difficult>{difficult}</difficult>"
        f"<bndbox>{corners}</bndbox></object>"
    )


def _voc(root: Path) -> Path:
    _voc_file(
        root, "a", _voc_object("dog", (11, 11, 30, 40)) + _voc_object("cat", (1, 1, 64, 48), 1)
    )
    _voc_file(root, "b", _voc_object("cat", (5, 5, 20, 20)))
    (root / "ImageSets" / "Main").mkdir(parents=True)
    (root / "ImageSets" / "Main" / "train.txt").write_text("a\n")
    (root / "ImageSets" / "Main" / "val.txt").write_text("b\n")
    return root


def test_a_voc_set_inside_a_vocdevkit_is_indexed_with_difficult_as_ignored(tmp_path):
    _voc(tmp_path / "VOCdevkit" / "VOC2012")
    d = _data(tmp_path / "VOCdevkit")
    line = resolve_detection(d, "train")
    assert "a Pascal VOC set, 20 classes" in line and "1 difficult object" in line
    gt = _gt(d, "train")
    dog, cat = gt["annotations"]
    assert gt["categories"][11]["name"] == "dog" and dog["category_id"] == 12  # VOC's order
    assert dog["bbox"] == [10.0, 10.0, 20.0, 30.0] and dog["iscrowd"] == 0
    assert cat["iscrowd"] == 1 and cat["bbox"] == [0.0, 0.0, 64.0, 48.0]


def test_voc_names_outside_voc_s_twenty_are_sorted(tmp_path):
    root = tmp_path / "voc"
    _voc_file(root, "a", _voc_object("zebra", (2, 2, 9, 9)) + _voc_object("ant", (2, 2, 9, 9)))
    _voc_file(root, "b", _voc_object("ant", (2, 2, 9, 9)))
    (root / "ImageSets" / "Main").mkdir(parents=True)
    (root / "ImageSets" / "Main" / "train.txt").write_text("a\n")
    (root / "ImageSets" / "Main" / "val.txt").write_text("b\n")
    d = _data(root)
    resolve_detection(d, "train")
    assert [c["name"] for c in _gt(d, "val")["categories"]] == ["ant", "zebra"]


@pytest.mark.parametrize("bad, why", [
    ("<size></size>", "no <size>"),
    ("<size><width>64</width><height>48</height></size>" + _voc_object("cat", (10, 10, 80, 20)),
     "outside its 64 x 48 image"),
])  # fmt: skip
def test_bad_voc_annotations_are_named(tmp_path, bad, why):
    root = _voc(tmp_path / "voc")
    (root / "Annotations" / "b.xml").write_text(f"<annotation>{bad}</annotation>")
    with pytest.raises(ConfigError, match=rf"b\.xml: .*{why}"):
        resolve_detection(_data(root), "train")


def test_an_xml_declaring_entities_is_refused_not_expanded(tmp_path):
    root = _voc(tmp_path / "voc")
    laughs = ('<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
              '<!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">]>'
              "<annotation><filename>b.jpg</filename>&lol2;</annotation>")  # fmt: skip
    (root / "Annotations" / "b.xml").write_text(laughs)
    with pytest.raises(
        ConfigError, match=r"b\.xml: declares XML entities \(refused, not expanded\)"
    ):
        resolve_detection(_data(root), "train")


def test_a_missing_voc_split_names_those_there(tmp_path):
    root = _voc(tmp_path / "voc")
    with pytest.raises(
        ConfigError, match=r"trainval\.txt does not exist: the VOC splits there are train, val"
    ):
        resolve_detection(_data(root, train_split="trainval"), "train")


# -- COCO layouts ----------------------------------------------------------------------------------


def _coco_split(folder: Path, annotations: Path, categories: list[dict]) -> None:
    _image(folder / "a.jpg")
    annotations.parent.mkdir(parents=True, exist_ok=True)
    annotations.write_text(json.dumps({
        "images": [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 48}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 2, 10, 10],
                         "area": 100, "iscrowd": 0}],
        "categories": categories,
    }))  # fmt: skip


def test_a_roboflow_export_is_read_without_its_group_category(tmp_path):
    root = tmp_path / "rf"
    categories = [{"id": 0, "name": "pets", "supercategory": "none"},
                  {"id": 1, "name": "cat", "supercategory": "pets"},
                  {"id": 2, "name": "dog", "supercategory": "pets"}]  # fmt: skip
    for split in ("train", "valid"):
        _coco_split(root / split, root / split / "_annotations.coco.json", categories)
    d = _data(root)
    line = resolve_detection(d, "train")
    # the counts as YOLO's and VOC's line gives them; the group category is not a class
    assert (
        "COCO in Roboflow's layout, 2 classes; train 1 image, 1 box; valid 1 image, 1 box" in line
    ) and "'pets'" in line
    assert d.val_split == "valid" and d.found == "coco (Roboflow)"
    assert [c["name"] for c in _gt(d, "valid")["categories"]] == ["cat", "dog"]
    assert Path(d.images.format(split="valid")) == root / "valid"


def test_a_cvat_export_with_one_image_folder(tmp_path):
    root = tmp_path / "cvat"
    for split in ("train", "val"):
        _coco_split(root / "images", root / "annotations" / f"instances_{split}.json",
                    [{"id": 1, "name": "cat", "supercategory": ""}])  # fmt: skip
    d = _data(root)
    resolve_detection(d, "train")
    assert d.found == "coco (CVAT / Label Studio)" and Path(d.images) == root / "images"
    assert d.annotations == str(root / "annotations/instances_{split}.json")


def test_an_export_whose_file_names_hold_the_split_folder_reads_them_from_images(tmp_path):
    """images/train/a.jpg named "train/a.jpg" in its file: the images are read from images/, not
    images/train/train/."""
    root = tmp_path / "cvat"
    for split in ("train", "val"):
        annotations = root / "annotations" / f"instances_{split}.json"
        _coco_split(root / "images" / split, annotations,
                    [{"id": 1, "name": "cat", "supercategory": ""}])  # fmt: skip
        coco = json.loads(annotations.read_text())
        coco["images"][0]["file_name"] = f"{split}/a.jpg"
        annotations.write_text(json.dumps(coco))
    d = _data(root)
    line = resolve_detection(d, "train")
    assert "train 1 image, 1 box" in line, line
    assert Path(d.images) == root / "images"


def test_a_cvat_export_of_one_task_is_evaluated_and_its_split_named_for_training(tmp_path):
    """CVAT exports a task without subsets as annotations/instances_default.json: an evaluation
    reads that one split as val; training, which needs two, names the splits there and the key."""
    root = tmp_path / "cvat"
    _coco_split(root / "images", root / "annotations" / "instances_default.json",
                [{"id": 1, "name": "cat", "supercategory": ""}])  # fmt: skip
    d = _data(root)
    line = resolve_detection(d, "eval")
    assert d.val_split == "default" and "default 1 image, 1 box" in line, line
    with pytest.raises(
        ConfigError,
        match=r"cvat is COCO in CVAT / Label Studio's layout with the split default "
        r"\(annotations/instances_<split>\.json\), no train or val: choose with "
        r"data\.train_split=<one of default> data\.val_split=<one of default> \(an export of one "
        r"split: training on it and evaluating on it scores the training images\); or cut train "
        r"and val from it: python tools/data\.py split data=detection data\.root=.*cvat val=0\.2 "
        r"out=<a new folder>$",
    ):
        resolve_detection(_data(root), "train")


def test_a_relative_data_root_reads_each_format(tmp_path, monkeypatch):
    """data.root=sets/<set> from the folder above: a YOLO set and a CVAT export resolve to paths
    that exist (a relative root was joined to the set's paths twice: sets/yolo/sets/yolo/...),
    and the run's config keeps the absolute root."""
    from visiondist.data.formats.exports import coco_paths

    _yolo(tmp_path / "sets" / "yolo", {"train": {"a": "0 0.5 0.5 0.2 0.2\n"},
                                       "val": {"v": "1 0.5 0.5 0.2 0.2\n"}})  # fmt: skip
    for split in ("train", "val"):
        root = tmp_path / "sets" / "cvat"
        _coco_split(root / "images", root / "annotations" / f"instances_{split}.json",
                    [{"id": 1, "name": "cat", "supercategory": ""}])  # fmt: skip
    monkeypatch.chdir(tmp_path)
    for name in ("yolo", "cvat"):
        d = _data(Path("sets") / name)
        resolve_detection(d, "train")
        assert d.root == str(tmp_path / "sets" / name)
        for split in ("train", "val"):
            images, annotations = coco_paths(d, split)
            assert images.is_dir() and annotations.is_file(), (name, images, annotations)


def test_a_data_yaml_without_names_is_refused_where_they_are_misspelt(tmp_path, capsys):
    """`name:` (or `classes:`) instead of `names:` would call the classes class0.. in the run, its
    weights and its predictions: refused naming the key. Only `nc:` is read as Ultralytics reads
    it (class0..), said once."""
    from visiondist.data.formats.yolo import read_yaml

    root = _yolo(tmp_path / "set", {"train": {"a": ""}, "val": {"v": ""}})
    for key in ("name", "Names", "classes"):
        (root / "data.yaml").write_text(
            json.dumps(
                {"path": ".", "train": "images/train", "val": "images/val", "nc": 3, key: NAMES}
            )  # fmt: skip
        )
        with pytest.raises(
            ConfigError, match=rf"data\.yaml has no names but a `{key}:`: spell it `names:`"
        ):
            read_yaml(root / "data.yaml")
    (root / "data.yaml").write_text(
        json.dumps({"path": ".", "train": "images/train", "val": "images/val", "nc": 3})
    )
    assert read_yaml(root / "data.yaml").names == ["class0", "class1", "class2"]
    assert read_yaml(root / "data.yaml").names == ["class0", "class1", "class2"]
    assert capsys.readouterr().err == (
        f"warning: {root / 'data.yaml'} has no names, only nc: 3: the classes are called "
        "class0..class2 (add `names:` to name them)\n"
    )


def test_a_label_studio_coco_export_is_evaluated(tmp_path):
    """Label Studio's COCO export: result.json beside images/, file names that start with images/,
    category ids from 0. An evaluation reads its one split; a result.json that is Label Studio's
    own JSON (a list of tasks) is not taken for COCO."""
    from visiondist.data.formats.exports import coco_paths

    root = tmp_path / "ls"
    _image(root / "images" / "a.jpg")
    (root / "result.json").write_text(json.dumps({
        "images": [{"id": 0, "file_name": "images/a.jpg", "width": 64, "height": 48}],
        "annotations": [{"id": 0, "image_id": 0, "category_id": 0, "bbox": [1, 2, 10, 10],
                         "area": 100, "iscrowd": 0, "ignore": 0}],
        "categories": [{"id": 0, "name": "cat"}, {"id": 1, "name": "dog"}],
        "info": {"contributor": "Label Studio"},
    }))  # fmt: skip
    d = _data(root)
    line = resolve_detection(d, "eval")
    assert "is COCO in Label Studio's layout, 2 classes; result 1 image, 1 box" in line, line
    images, annotations = coco_paths(d, d.val_split)
    assert annotations == root / "result.json" and (images / "images" / "a.jpg").is_file()
    (root / "result.json").write_text(json.dumps([{"id": 1, "annotations": []}]))
    assert recognise(root) is None


def test_a_folder_of_no_format_known_is_one_line(tmp_path):
    (tmp_path / "x").mkdir()
    assert recognise(tmp_path / "x") is None
    with pytest.raises(ConfigError, match=r"is of no format known: a YOLO set has a data\.yaml"):
        resolve_detection(_data(tmp_path / "x"), "train")
    # an Ultralytics yaml under its own name: the root to give
    root = _yolo(tmp_path / "y", {"train": {"a": ""}, "val": {"b": ""}})
    (root / "data.yaml").rename(root / "shapes.yaml")
    with pytest.raises(
        ConfigError,
        match=rf"holds shapes.yaml but no data.yaml: give the set's yaml as the root, "
        rf"data.root={root / 'shapes.yaml'}$",
    ):
        resolve_detection(_data(root), "train")
    assert "a YOLO set" in resolve_detection(_data(root / "shapes.yaml"), "train")


def test_data_coco_on_a_yolo_folder_names_the_data_config_that_reads_it(tmp_path):
    from visiondist.preflight.inputs import _check_split

    root = _yolo(tmp_path / "set", {"train": {"a": ""}, "val": {"v": ""}})
    d = OmegaConf.create({"name": "coco", "format": "coco", "root": str(root),
                          "images": "{split}", "annotations": "annotations/instances_{split}.json",
                          "train_split": "train2017", "val_split": "val2017"})  # fmt: skip
    with pytest.raises(
        ConfigError,
        match=r"is a YOLO set \(data\.yaml\), not a tree of data=coco's "
        r"layout: read it with data=detection",
    ):
        _check_split(d, root, "train2017")


# -- one format from another -----------------------------------------------------------------------


def _three_forms(tmp_path: Path) -> dict[str, Path]:
    """One set as COCO (written from its YOLO index), YOLO and VOC."""
    yolo = _yolo(tmp_path / "yolo", {
        "train": {"a": "0 0.5 0.5 0.5 0.5\n1 0.3125 0.25 0.125 0.25\n", "b": "2 0.75 0.5 0.25 "
                                                                             "0.5\n"},
        "val": {"v": "1 0.5 0.5 0.25 0.25\n"},
    })  # fmt: skip
    d = _data(yolo)
    resolve_detection(d, "train")
    sources = {s: (_gt(d, s), Path(d.images)) for s in ("train", "val")}
    forms = {"yolo": yolo}
    for name, write in (("coco", write_coco), ("voc", write_voc)):
        write(sources, tmp_path / name)
        forms[name] = tmp_path / name
    return forms


def test_coco_yolo_and_voc_forms_of_one_set_are_the_same_ground_truth(tmp_path):
    forms = _three_forms(tmp_path)
    truth = {}
    for name, root in forms.items():
        d = _data(root)
        resolve_detection(d, "train")
        truth[name] = [
            [
                (a["image_id"], a["category_id"], a["bbox"], a["iscrowd"])
                for a in _gt(d, s)["annotations"]
            ]
            for s in (d.train_split, d.val_split)
        ]
    assert truth["yolo"] == truth["coco"] == truth["voc"]
    assert truth["yolo"][0][1] == (1, 2, [16.0, 6.0, 8.0, 12.0], 0)


def test_a_round_trip_through_yolo_gives_the_same_coco(tmp_path):
    forms = _three_forms(tmp_path)
    d = _data(forms["coco"])
    resolve_detection(d, "train")
    first = {s: _gt(d, s) for s in ("train", "val")}
    write_yolo({s: (first[s], Path(d.images.format(split=s))) for s in first}, tmp_path / "again")
    d2 = _data(tmp_path / "again")
    resolve_detection(d2, "train")
    for s in ("train", "val"):
        again = _gt(d2, s)
        assert [(a["bbox"], a["category_id"]) for a in again["annotations"]] == [
            (a["bbox"], a["category_id"]) for a in first[s]["annotations"]
        ]
        assert again["categories"] == first[s]["categories"]


def test_voc_from_splits_sharing_image_names_keeps_every_image_apart(tmp_path):
    """VOC keeps both splits' images in one folder: train/a.jpg and val/a.jpg become train_a and
    val_a, each with its own pixels and boxes, and the count says so. Without the prefix the val
    image would replace the train one and be listed in both splits."""
    from visiondist.data.formats.convert import convert

    yolo = _yolo(tmp_path / "yolo", {
        "train": {"a": "0 0.5 0.5 0.5 0.5\n", "b": "2 0.75 0.5 0.25 0.5\n"},
        "val": {"a": "1 0.5 0.5 0.25 0.25\n"},
    })  # fmt: skip
    _image(yolo / "images" / "val" / "a.jpg", color=(10, 240, 10))  # the val image's own pixels
    d = _data(yolo)
    resolve_detection(d, "train")
    counts = convert(d, "voc", tmp_path / "voc")
    renamed = "images named <split>_<name>: names both splits use"
    assert counts["train"][renamed] == 2 and counts["val"][renamed] == 1
    voc = tmp_path / "voc"
    assert sorted(p.name for p in (voc / "JPEGImages").iterdir()) == [
        "train_a.jpg",
        "train_b.jpg",
        "val_a.jpg",
    ]
    assert (voc / "ImageSets/Main/val.txt").read_text() == "val_a\n"
    assert Image.open(voc / "JPEGImages/val_a.jpg").getpixel((5, 5))[1] > 200
    assert Image.open(voc / "JPEGImages/train_a.jpg").getpixel((5, 5))[1] < 100
    back = _data(voc)
    resolve_detection(back, "train")
    boxes = {s: [(a["category_id"], a["bbox"]) for a in _gt(back, s)["annotations"]]
             for s in ("train", "val")}  # fmt: skip
    origin = {s: [(a["category_id"], a["bbox"]) for a in _gt(d, s)["annotations"]]
              for s in ("train", "val")}  # fmt: skip
    assert boxes == origin


def test_voc_keeps_image_names_no_split_shares(tmp_path):
    from visiondist.data.formats.convert import convert

    forms = _three_forms(tmp_path)
    assert sorted(p.stem for p in (forms["voc"] / "JPEGImages").iterdir()) == ["a", "b", "v"]
    d = _data(forms["yolo"])
    resolve_detection(d, "train")
    counts = convert(d, "voc", tmp_path / "voc2")
    assert not any(v for k, v in counts["train"].items() if k.startswith("images named"))


def test_voc_corners_are_whole_pixels_where_the_box_is_up_to_yolo_s_rounding(tmp_path):
    """YOLO's 6-digit fields put a corner at 19.99991 for pixel 20: VOC gets the whole pixel (VOC's
    files hold integers); a box's own fraction (9.6 px) is kept."""
    from visiondist.data.formats.convert import convert

    yolo = _yolo(tmp_path / "yolo", {
        "train": {"a": "0 0.406249 0.5 0.187501 0.25\n"},
        "val": {"b": "1 0.3 0.5 0.3 0.25\n"},
    })  # fmt: skip
    d = _data(yolo)
    resolve_detection(d, "train")
    convert(d, "voc", tmp_path / "voc")
    xml = (tmp_path / "voc" / "Annotations" / "a.xml").read_text()
    assert "<xmin>21</xmin><ymin>19</ymin><xmax>32</xmax><ymax>30</ymax>" in xml, xml
    assert "<xmin>10.6</xmin>" in (tmp_path / "voc" / "Annotations" / "b.xml").read_text()
