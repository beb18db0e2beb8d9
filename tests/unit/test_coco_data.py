"""COCO-format data rules, each with its outcome and its logged count; the built-in shapes_coco set;
grouped batches."""

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from visiondist.data.coco import CocoDetection
from visiondist.data.sampler import TrainBatchSampler

W, H = 40, 30


def _write_set(root, images, annotations, categories=((1, "a"), (3, "b"))):
    """A COCO-format set: `images` maps file name -> PIL image (or raw bytes for a broken file)."""
    (root / "img").mkdir(parents=True, exist_ok=True)
    entries = []
    for i, (name, content) in enumerate(images.items(), start=1):
        path = root / "img" / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            content.save(path)
        entries.append({"id": i, "file_name": name, "width": W, "height": H})
    anns = [{"id": k, "area": 1.0, "iscrowd": 0, **a} for k, a in enumerate(annotations, start=1)]
    data = {
        "images": entries,
        "annotations": anns,
        "categories": [{"id": c, "name": n} for c, n in categories],
    }
    (root / "ann.json").write_text(json.dumps(data))
    return root / "img", root / "ann.json"


def _rgb(value=(200, 10, 10)):
    return Image.new("RGB", (W, H), value)


def test_boxes_crowd_degenerate_and_empty_images(tmp_path, caplog):
    images = {"one.png": _rgb(), "two.png": _rgb(), "empty.png": _rgb(), "only_crowd.png": _rgb()}
    anns = [
        # fine: xywh -> xyxy, label 2 (second category)
        {"image_id": 1, "category_id": 3, "bbox": [5, 6, 10, 8]},
        # leaves the image: clipped to 40 x 30
        {"image_id": 1, "category_id": 1, "bbox": [30, 20, 20, 20]},
        # entirely left of the image: degenerate
        {"image_id": 1, "category_id": 1, "bbox": [-5, -5, 4, 30]},
        {"image_id": 2, "category_id": 1, "bbox": [1, 1, 0.5, 10]},  # 0.5 px wide: degenerate
        {"image_id": 2, "category_id": 3, "bbox": [2, 2, 5, 5]},
        {"image_id": 4, "category_id": 1, "bbox": [2, 2, 20, 20], "iscrowd": 1},
    ]
    root, ann = _write_set(tmp_path, images, anns)
    with caplog.at_level(logging.INFO):
        train = CocoDetection(root, ann, train=True)
    assert "4 images" not in caplog.text
    # the box at (30, 20) of size 20 x 20 reaches past the 40 x 30 image: kept, clipped, counted
    assert (
        "2 images, 3 boxes (1 clipped to their image); left out: 1 crowd box, 2 degenerate boxes, "
        "2 images without usable boxes" in caplog.text
    )
    first = "annotation 2 of image 1, [30.0, 20.0, 20.0, 20.0] on 40 x 30"  # pycocotools' id
    assert train.counts.clipped_first == first
    assert [r.image_id for r in train.records] == [1, 2]
    image, target = train[0]
    # made float in [0, 1] on the device
    assert image.shape == (3, H, W) and image.dtype == torch.uint8
    assert target["boxes"].tolist() == [[5, 6, 15, 14], [30, 20, 40, 30]]
    assert target["labels"].tolist() == [2, 1]
    assert train.cat_of == {1: 1, 2: 3}

    # evaluation keeps every image, crowd boxes stay out
    evaluation = CocoDetection(root, ann, train=False)
    assert [r.image_id for r in evaluation.records] == [1, 2, 3, 4]
    assert evaluation[3][1]["boxes"].shape == (0, 4) and evaluation.counts.crowd_boxes == 1
    # the index is arrays (no object per image or box for forked workers to copy), pycocotools' COCO
    # is not kept
    index = evaluation.index
    assert index.image_ids.tolist() == [1, 2, 3, 4] and index.offsets.tolist() == [0, 2, 3, 3, 3]
    assert index.boxes.dtype == np.float32 and index.boxes.tolist() == [
        [5, 6, 15, 14],
        [30, 20, 40, 30],
        [2, 2, 7, 7],
    ]
    assert index.labels.tolist() == [2, 1, 2] and index.paths[1] == str(root / "two.png")
    assert not hasattr(evaluation, "coco")


def test_annotations_of_images_not_in_the_file_are_counted(tmp_path, caplog):
    anns = [
        {"image_id": 1, "category_id": 1, "bbox": [2, 2, 10, 10]},
        {"image_id": 7, "category_id": 1, "bbox": [2, 2, 10, 10]},  # no image 7
        {"image_id": 9, "category_id": 3, "bbox": [1, 1, 5, 5]},  # no image 9
    ]
    root, ann = _write_set(tmp_path, {"a.png": _rgb()}, anns)
    with caplog.at_level(logging.INFO):
        data = CocoDetection(root, ann, train=True)
    assert data.counts.orphan_annotations == 2 and data.counts.boxes == 1
    assert (
        "1 image, 1 box; left out: 0 crowd boxes, 0 degenerate boxes, 0 images without usable "
        "boxes, 2 annotations whose image_id has no image"
    ) in caplog.text


@pytest.mark.parametrize("mode", ["L", "CMYK", "RGBA", "P", "I;16"])
def test_any_image_mode_is_read_as_rgb(tmp_path, mode):
    source = _rgb((120, 60, 30))
    if mode == "I;16":
        image = Image.new("I;16", (W, H), 300)
    elif mode == "P":
        image = source.convert("P", palette=Image.Palette.ADAPTIVE)
    else:
        image = source.convert(mode)
    suffix = "jpg" if mode == "CMYK" else "png"
    root, ann = _write_set(
        tmp_path, {f"x.{suffix}": image}, [{"image_id": 1, "category_id": 1, "bbox": [1, 1, 9, 9]}]
    )
    tensor, _ = CocoDetection(root, ann, train=True)[0]
    assert tensor.shape == (3, H, W)
    if mode in ("RGBA", "P"):
        assert tensor[:, 0, 0].tolist() == [120, 60, 30]
    if mode == "L":
        assert tensor[0].equal(tensor[1]) and tensor[1].equal(tensor[2])


@pytest.mark.parametrize(
    "name", ["../outside.png", "/etc/passwd", "img/../../x.png", "..\\evil.png"]
)
def test_file_name_escaping_the_image_root_is_refused(tmp_path, name):
    (tmp_path / "img").mkdir()
    data = {
        "images": [{"id": 1, "file_name": name, "width": W, "height": H}],
        "annotations": [],
        "categories": [{"id": 1, "name": "a"}],
    }
    (tmp_path / "ann.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="escapes the image folder"):
        CocoDetection(tmp_path / "img", tmp_path / "ann.json", train=False)


def test_unknown_category_names_the_annotation(tmp_path):
    root, ann = _write_set(
        tmp_path, {"a.png": _rgb()}, [{"image_id": 1, "category_id": 7, "bbox": [1, 1, 5, 5]}]
    )
    with pytest.raises(ValueError, match=r"annotation 1 \(image 1\) has category_id 7"):
        CocoDetection(root, ann, train=True)


def test_unreadable_images_are_replaced_logged_once_and_bounded(tmp_path, caplog):
    box = [1, 1, 9, 9]
    images = {
        "ok0.png": _rgb((10, 10, 10)),
        "bad.png": b"not an image",
        "missing.png": None,
        "ok3.png": _rgb((30, 30, 30)),
    }
    root, ann = _write_set(
        tmp_path, images, [{"image_id": i, "category_id": 1, "bbox": box} for i in range(1, 5)]
    )
    data = CocoDetection(root, ann, train=True, max_bad_images=3)
    with caplog.at_level(logging.WARNING):
        first, _ = data[1]  # bad.png -> missing.png -> ok3.png
        again, _ = data[1]
    assert first[0, 0, 0] == 30 and again.equal(first)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # each broken file once, though each is read twice
    assert "bad.png" in warnings[0] and "missing.png" in warnings[1]
    assert all("each unreadable file is named once" in w for w in warnings)
    assert data._bad.replaced == 4

    strict = CocoDetection(root, ann, train=True, max_bad_images=2)
    with pytest.raises(RuntimeError, match="2 consecutive images from index 1 could not be read"):
        strict[1]
    with pytest.raises(RuntimeError, match="cannot read evaluation image"):
        CocoDetection(root, ann, train=False)[1]


def test_shapes_coco_is_deterministic_coco_format(tmp_path):
    from visiondist.synthetic.shapes_coco import ensure_shapes_coco

    spec = SimpleNamespace(train_images=24, val_images=12, image_size=64, seed=0)
    a, b = ensure_shapes_coco(tmp_path / "a", spec), ensure_shapes_coco(tmp_path / "b", spec)
    for split in ("train", "val"):
        ja = json.loads((a / "annotations" / f"instances_{split}.json").read_text())
        assert ja == json.loads((b / "annotations" / f"instances_{split}.json").read_text())
        assert (a / split / "000003.jpg").read_bytes() == (b / split / "000003.jpg").read_bytes()
    train = json.loads((a / "annotations" / "instances_train.json").read_text())
    per_image = np.bincount([x["image_id"] for x in train["annotations"]], minlength=25)[1:]
    # several objects per image, some empty images
    assert per_image.max() > 1 and (per_image == 0).any()
    assert len({x["category_id"] for x in train["annotations"]}) >= 4
    assert len({(i["width"], i["height"]) for i in train["images"]}) > 1
    data = CocoDetection(a / "train", a / "annotations" / "instances_train.json", train=True)
    assert len(data) == 24 - int((per_image == 0).sum()) and data.counts.degenerate_boxes == 0


def test_grouped_batches_hold_one_group_and_split_by_dp_rank():
    groups = np.array([0, 1] * 10 + [1] * 5)  # 10 of group 0, 15 of group 1
    full = TrainBatchSampler(25, 4, 0, 1, seed=3, groups=groups)
    assert full.steps_per_epoch == 10 // 4 + 15 // 4
    batches = full.global_batches(epoch=1)
    assert all(len(set(groups[b])) == 1 for b in batches)
    halves = [TrainBatchSampler(25, 4, r, 2, seed=3, groups=groups) for r in (0, 1)]
    for sampler in halves:
        sampler.set_epoch(1)
    together = [[i for i, _ in a] + [i for i, _ in b] for a, b in zip(*halves)]
    assert together == [b.tolist() for b in batches]


def test_unreadable_val_images_of_a_coco_set_are_named_before_any_rank_starts(tmp_path):
    """tools/eval.py's and train.py's check (`load_config`), on a COCO-format set generated earlier:
    every unreadable val image with its reason, and the annotation file's part of the fix."""
    from helpers import REPO

    from visiondist.cli import load_config
    from visiondist.config import ConfigError
    from visiondist.synthetic.shapes_coco import ensure_shapes_coco

    overrides = [
        "model=fasterrcnn_mobilenet_v3",
        "data=shapes_coco",
        f"data.root={tmp_path / 'coco'}",
        "data.synthetic.train_images=8",
        "data.synthetic.val_images=6",
        "data.synthetic.image_size=64",
        "data.batch_size=4",
    ]
    cfg = load_config(REPO / "configs", overrides, inputs=None)
    root = ensure_shapes_coco(cfg.data.root, cfg.data.synthetic)
    load_config(REPO / "configs", overrides, inputs="eval")  # all readable
    (root / "val" / "000002.jpg").write_bytes(b"\xff\xd8 cut short")
    (root / "val" / "000005.jpg").unlink()
    for inputs in ("eval", "train"):
        with pytest.raises(ConfigError) as refused:
            load_config(REPO / "configs", overrides, inputs=inputs)
        assert str(refused.value) == (
            f"2 of 6 val images cannot be read: {root / 'val' / '000002.jpg'}: truncated JPEG (no "
            f"end-of-image marker); {root / 'val' / '000005.jpg'}: the file does not exist: fix "
            "or remove them (every val image is scored; remove an image's entry from the "
            "annotation file too)"
        )


def test_a_missing_annotation_file_names_the_splits_beside_it(tmp_path):
    """data=coco looks for instances_train2017.json; a tool's export named by split names
    (instances_train.json, instances_val.json) is named, with the settings that read it."""
    from visiondist.data.coco import CocoDetection

    annotations = tmp_path / "annotations"
    annotations.mkdir()
    for split in ("train", "val"):
        (annotations / f"instances_{split}.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as missing:
        CocoDetection(tmp_path / "train2017", annotations / "instances_train2017.json", True)
    assert str(missing.value) == (
        f"no COCO annotation file {annotations / 'instances_train2017.json'}: check data.root and "
        f"data.annotations; {annotations} holds instances_train.json, instances_val.json: set "
        "data.train_split / data.val_split to their split names (e.g. data.train_split=train), "
        "or read it with data=detection, which finds them"
    )
