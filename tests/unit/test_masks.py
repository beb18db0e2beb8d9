"""Instance masks: the built-in set's masks, the loader (decoded per image, through every geometric
augmentation as the boxes), segm scoring, the Mask R-CNN models and their configuration checks."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import REPO

from visiondist.data import masks as masks_lib
from visiondist.data.coco import CocoDetection
from visiondist.data.transforms import DetectionTransform
from visiondist.synthetic.shapes_coco import ensure_shapes_coco

CONFIGS = REPO / "configs"
SPEC = SimpleNamespace(train_images=48, val_images=8, image_size=64, seed=0)


@pytest.fixture(scope="module")
def masked_set(tmp_path_factory):
    return ensure_shapes_coco(tmp_path_factory.mktemp("data") / "shapes_coco", SPEC)


def _bbox(mask: np.ndarray) -> list[int]:
    ys, xs = np.nonzero(mask)
    return [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]


def test_the_built_in_set_has_a_mask_per_shape_and_crowd_regions(masked_set):
    coco = json.loads((masked_set / "annotations" / "instances_train.json").read_text())
    sizes = {im["id"]: (im["height"], im["width"]) for im in coco["images"]}
    anns = coco["annotations"]
    kinds = {"polygon": 0, "rle": 0, "crowd": 0}
    for ann in anns:
        h, w = sizes[ann["image_id"]]
        mask = masks_lib.decode([ann["segmentation"]], h, w)[0]
        assert mask.sum() == ann["area"] > 0  # COCO's area: the mask's pixels
        x, y, bw, bh = ann["bbox"]
        if ann["iscrowd"]:
            kinds["crowd"] += 1
            assert isinstance(ann["segmentation"]["counts"], list)  # uncompressed, as COCO's crowds
            assert _bbox(mask) == [round(x), round(y), round(x + bw), round(y + bh)]
        elif isinstance(ann["segmentation"], list):
            kinds["polygon"] += 1  # nothing covers it: the mask fills its box
            assert np.allclose(_bbox(mask), [x, y, x + bw, y + bh], atol=1.5)
        else:
            kinds["rle"] += 1  # a ring, or a shape partly under a later one: inside its box
            mx1, my1, mx2, my2 = _bbox(mask)
            assert mx1 >= x - 1.5 and my1 >= y - 1.5 and mx2 <= x + bw + 1.5 and my2 <= y + bh + 1.5
    assert min(kinds.values()) >= 1, kinds
    assert kinds["polygon"] > kinds["rle"] > kinds["crowd"]


def test_a_copy_from_the_boxes_only_version_is_generated_again(tmp_path):
    root = ensure_shapes_coco(
        tmp_path / "set", SimpleNamespace(train_images=4, val_images=2, image_size=48, seed=1)
    )
    meta = json.loads((root / "dataset.json").read_text())
    del meta["version"]  # as the generator before masks wrote it
    (root / "dataset.json").write_text(json.dumps(meta))
    ann = root / "annotations" / "instances_val.json"
    ann.write_text(json.dumps({**json.loads(ann.read_text()), "annotations": []}))
    ensure_shapes_coco(root, SimpleNamespace(train_images=4, val_images=2, image_size=48, seed=1))
    assert json.loads((root / "dataset.json").read_text())["version"] == 2
    assert all("segmentation" in a for a in json.loads(ann.read_text())["annotations"])
    assert not list(tmp_path.glob(".set.*-*"))  # no temporary or old copy left beside it


def _rectangles(n: int, h: int, w: int, rng) -> tuple[np.ndarray, np.ndarray]:
    boxes, masks = [], []
    for _ in range(n):
        x1, y1 = rng.integers(0, w - 12), rng.integers(0, h - 12)
        x2, y2 = x1 + rng.integers(8, w - x1 + 1), y1 + rng.integers(8, h - y1 + 1)
        mask = np.zeros((h, w), dtype=np.uint8)
        mask[y1:y2, x1:x2] = 1
        boxes.append([x1, y1, x2, y2])
        masks.append(mask)
    return np.asarray(boxes, dtype=np.float32), np.stack(masks)


@pytest.mark.parametrize("jitter", [False, True])
def test_masks_follow_the_boxes_through_resize_jitter_crop_and_flip(jitter):
    """Rectangles: after the detection transform each kept mask still fills its box (to the pixel or
    so that resizing a mask costs), and a box a crop removes takes its mask with it."""
    cfg = SimpleNamespace(
        min_size=96,
        max_size=160,
        large_scale_jitter=jitter,
        lsj_scale=(0.3, 2.0),
        hflip=0.5,
        color_jitter=0.3,
    )
    transform = DetectionTransform(cfg, seed=0)
    rng = np.random.default_rng(0)
    dropped = 0
    for index in range(12):
        h, w = int(rng.integers(40, 80)), int(rng.integers(40, 80))
        boxes, masks = _rectangles(4, h, w, rng)
        image = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        out_image, out_boxes, labels, out_masks = transform(
            image, boxes, np.arange(1, 5), index, 0, masks=masks
        )
        assert out_masks.shape == (len(out_boxes), *out_image.shape[:2]) and len(labels) == len(
            out_boxes
        )
        dropped += 4 - len(out_boxes)
        # nearest-neighbour resizing (torchvision's for masks) moves an edge by up to half a source
        # pixel
        scale = min(96 / min(h, w), 160 / max(h, w)) * (2.0 if jitter else 1.0)
        for box, mask in zip(out_boxes, out_masks):
            assert np.allclose(_bbox(mask), box, atol=1 + scale / 2), (index, box, _bbox(mask))
        plain = transform(image, boxes, np.arange(1, 5), index, 0)  # the same draw without masks
        assert np.array_equal(plain[0], out_image) and np.array_equal(plain[1], out_boxes)
    assert dropped > 0 if jitter else dropped == 0


@pytest.mark.smoke
def test_the_loader_keeps_segmentations_as_text_and_decodes_them_per_image(masked_set, tmp_path):
    ann_file = masked_set / "annotations" / "instances_train.json"
    data = CocoDetection(masked_set / "train", ann_file, train=True, masks=True)
    coco = json.loads(ann_file.read_text())
    kept = [a for a in coco["annotations"] if not a["iscrowd"]]
    assert (
        len(data.index.segmentations) == len(kept)
        and data.index.segmentations.nbytes < ann_file.stat().st_size
    )
    image, target = data[0]
    record = data.index.record(0)
    mine = [a for a in kept if a["image_id"] == record.image_id]
    assert torch.equal(
        target["masks"],
        torch.from_numpy(
            masks_lib.decode([a["segmentation"] for a in mine], record.height, record.width)
        ),
    )
    assert target["masks"].shape == (len(target["boxes"]), *image.shape[1:])
    # box models: none read
    assert "masks" not in CocoDetection(masked_set / "train", ann_file, train=True)[0][1]

    for a in coco["annotations"]:
        a.pop("segmentation")
    boxes_only = tmp_path / "boxes.json"
    boxes_only.write_text(json.dumps(coco))
    with pytest.raises(
        ValueError,
        match=r"boxes.json: (\d+) of its \1 instances have no valid segmentation \(annotation ids "
        r"1, 2, .* and \d+ more: .*\), which a model with a mask head trains on: .*or train a "
        r"model without masks \(fasterrcnn_\* for maskrcnn_\*",
    ):
        CocoDetection(masked_set / "train", boxes_only, train=True, masks=True)


def test_instances_without_a_valid_segmentation_are_left_out_counted_and_named(
    masked_set, tmp_path
):
    """An empty segmentation and a polygon of 2 points are treated alike (detectron2's rule): the
    instance is left out of mask training, box and all, counted and named; a short polygon beside a
    valid one is dropped from it."""
    ann_file = masked_set / "annotations" / "instances_train.json"
    coco = json.loads(ann_file.read_text())
    polygons = [
        a for a in coco["annotations"] if not a["iscrowd"] and isinstance(a["segmentation"], list)
    ]
    empty, two_points, mixed = polygons[0], polygons[1], polygons[2]
    empty["segmentation"] = []
    two_points["segmentation"] = [[1.0, 1.0, 5.0, 5.0]]
    mixed["segmentation"] = [*mixed["segmentation"], [0.0, 0.0, 3.0, 3.0]]
    messy = tmp_path / "messy.json"
    messy.write_text(json.dumps(coco))
    clean = CocoDetection(masked_set / "train", ann_file, train=True, masks=True)
    data = CocoDetection(masked_set / "train", messy, train=True, masks=True)
    assert data.counts.without_mask == 2 and data.counts.without_mask_ids == [
        empty["id"],
        two_points["id"],
    ]
    assert data.counts.boxes == clean.counts.boxes - 2
    assert (
        f"annotation ids {empty['id']}, {two_points['id']}: empty, or polygons"
        in data.counts.describe()
    )
    kept = [s for s in (data.index.segmentations.get(0, len(data.index.segmentations)))]
    assert [[0.0, 0.0, 3.0, 3.0]] not in kept and all(
        len(p) >= 6 for s in kept if isinstance(s, list) for p in s
    )


def test_polygons_written_as_points_or_unwrapped_train_and_score_as_coco_s_form(
    masked_set, tmp_path
):
    """labelme-style `[[x, y], ...]` points and a flat `[x1, y1, ...]` not wrapped in the outer list
    (what home-made converters write) are read as COCO's `[[x1, y1, ...]]`: the same masks in
    training, counted and the first named, and the same ground truth for scoring. Under a mask
    model a val instance without a valid segmentation is refused, naming it (COCOeval scores every
    val mask); a training split that lost most of its instances is refused, not trained on."""
    from visiondist.evaluation.coco_scoring import ground_truth

    ann_file = masked_set / "annotations" / "instances_train.json"
    coco = json.loads(ann_file.read_text())
    polygons = [
        a for a in coco["annotations"] if not a["iscrowd"] and isinstance(a["segmentation"], list)
    ]
    single = [a for a in polygons if len(a["segmentation"]) == 1]
    as_points, as_flat = single[0], single[1]
    as_points["segmentation"] = [
        [x, y]
        for x, y in zip(as_points["segmentation"][0][0::2], as_points["segmentation"][0][1::2])
    ]
    as_flat["segmentation"] = as_flat["segmentation"][0]
    written = tmp_path / "tool.json"
    written.write_text(json.dumps(coco))
    clean = CocoDetection(masked_set / "train", ann_file, train=True, masks=True)
    data = CocoDetection(masked_set / "train", written, train=True, masks=True)
    assert data.counts.reshaped == 2 and data.counts.without_mask == 0
    assert data.counts.reshaped_first.startswith(f"annotation {as_points['id']}, [[")
    n = len(clean.index.segmentations)
    assert data.index.segmentations.get(0, n) == clean.index.segmentations.get(0, n)
    truth = {a["id"]: a["segmentation"] for a in ground_truth(ann_file)["annotations"]}
    read = {a["id"]: a["segmentation"] for a in ground_truth(written)["annotations"]}
    assert read == truth

    val = json.loads((masked_set / "annotations" / "instances_val.json").read_text())
    bad = next(a for a in val["annotations"] if not a["iscrowd"])
    bad["segmentation"] = [[1.0, 1.0, 5.0, 5.0]]
    bad_val = tmp_path / "val.json"
    bad_val.write_text(json.dumps(val))
    with pytest.raises(
        ValueError,
        match=rf"annotation {bad['id']} \(image {bad['image_id']}\) of .*val.json has no valid "
        r"segmentation \(\[\[1.0, 1.0, 5.0, 5.0\]\]: empty, or polygons of fewer than 3 points\), "
        r"and a mask model is scored on every val instance's mask",
    ):
        CocoDetection(masked_set / "val", bad_val, train=False, masks=True)
    assert len(CocoDetection(masked_set / "val", bad_val, train=False))  # a box model: its boxes

    instances = [a for a in coco["annotations"] if not a["iscrowd"]]
    for a in instances[: len(instances) // 2 + 2]:
        a["segmentation"] = [[0.0, 0.0, 3.0, 3.0]]
    mostly = tmp_path / "mostly_bad.json"
    mostly.write_text(json.dumps(coco))
    with pytest.raises(
        ValueError, match=r"mostly_bad.json: \d+ of its \d+ instances have no valid"
    ):
        CocoDetection(masked_set / "train", mostly, train=True, masks=True)


def test_the_ground_truth_as_predictions_scores_1_for_masks_and_boxes(masked_set):
    from visiondist.evaluation.coco_scoring import STAT_NAMES, score

    ann_file = masked_set / "annotations" / "instances_val.json"
    coco = json.loads(ann_file.read_text())
    sizes = {im["id"]: (im["height"], im["width"]) for im in coco["images"]}
    truth = [a for a in coco["annotations"] if not a["iscrowd"]]
    dets = np.array([[a["image_id"], *a["bbox"], 1.0, a["category_id"]] for a in truth])
    rles = [
        masks_lib.encode(masks_lib.decode([a["segmentation"]], *sizes[a["image_id"]]))[0]
        for a in truth
    ]
    segm, box = score(ann_file, dets, segmentations=rles), score(ann_file, dets)
    assert segm["mAP"] == pytest.approx(1.0) and box["mAP"] == pytest.approx(1.0)
    shifted = [
        masks_lib.encode(
            np.roll(masks_lib.decode([a["segmentation"]], *sizes[a["image_id"]]), 3, axis=2)
        )[0]
        for a in truth
    ]
    worse = score(ann_file, dets, segmentations=shifted)
    # masks scored as masks, not as boxes
    assert worse["mAP"] < 0.9 and set(worse) == set(STAT_NAMES)


@pytest.mark.smoke  # torch 2.11's torchvision builds and trains it too
def test_mask_rcnn_on_mobilenet_trains_on_masks_and_predicts_them():
    from visiondist.models.detection import build_torchvision_detector, has_masks

    cfg = SimpleNamespace(
        arch="maskrcnn_mobilenet_v3_large_fpn",
        kwargs={},
        num_classes=3,
        min_size=64,
        max_size=96,
        backbone_weights=None,
        weights=None,
        anchor_scale=1.0,
        roi_sampling_ratio=None,
        get=lambda key, default=None: None,
    )
    torch.manual_seed(0)
    model = build_torchvision_detector(cfg)
    assert has_masks({"arch": cfg.arch}) and not has_masks({"arch": "fasterrcnn_resnet50_fpn"})
    rng = np.random.default_rng(0)
    boxes, masks = _rectangles(2, 64, 64, rng)
    target = {
        "boxes": torch.from_numpy(boxes),
        "labels": torch.tensor([1, 2]),
        "masks": torch.from_numpy(masks),
    }
    losses = model([torch.rand(3, 64, 64)], [target])
    assert "loss_mask" in losses and all(torch.isfinite(v) for v in losses.values())
    model.eval()
    with torch.no_grad():
        out = model([torch.rand(3, 64, 64)])[0]
    assert out["masks"].shape[1:] == (1, 64, 64) and len(out["masks"]) == len(out["boxes"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model=vit_tiny", "model.masks=true"],
            "model.masks=true adds a mask head to a detector; vit_tiny is a classifier",
        ),
        (
            ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco", "model.masks=true"],
            "use model=maskrcnn_r50, maskrcnn_r50_v2 or maskrcnn_mobilenet_v3",
        ),
        (
            ["model=maskrcnn_mobilenet_v3", "data=shapes_coco", "model.masks=false"],
            "always predicts masks; for boxes only use model=fasterrcnn_mobilenet_v3",
        ),
        (
            ["model=fasterrcnn_r50", "data=shapes_coco", "trainer.best_metric=val_segm_mAP"],
            r"val_segm_mAP is a mask metric, and fasterrcnn_r50 predicts no masks: "
            r".*model=maskrcnn_mobilenet_v3",
        ),
    ],
)
def test_masks_asked_of_a_model_without_a_mask_head_are_refused(overrides, message):
    from visiondist.config import ConfigError, compose
    from visiondist.plan import check

    with pytest.raises(ConfigError, match=message):
        check(compose(CONFIGS, [*overrides, "trainer.accelerator=cpu"]), mandatory=False)


def test_a_mask_model_reports_mask_metrics_and_may_keep_its_best_by_them():
    from visiondist.config import compose
    from visiondist.models import eval_metrics

    for name in ("maskrcnn_mobilenet_v3", "maskrcnn_r50", "maskrcnn_r50_v2"):
        cfg = compose(CONFIGS, [f"model={name}", "data=shapes_coco"])
        assert "val_segm_mAP" in eval_metrics(cfg.model) and "val_mAP" in eval_metrics(cfg.model)
    vitdet = compose(CONFIGS, ["model=vitdet_tiny", "data=shapes_coco", "model.masks=true"])
    assert "val_segm_mAP" in eval_metrics(vitdet.model)
    assert "val_segm_mAP" not in eval_metrics(
        compose(CONFIGS, ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco"]).model
    )


def test_a_mask_rcnn_export_loads_strictly_into_torchvisions_builder(tmp_path):
    import torchvision.models.detection as tvd
    from safetensors.torch import load_file

    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.trained import Trained
    from visiondist.config import compose
    from visiondist.models import build_model

    cfg = compose(
        CONFIGS, ["model=maskrcnn_r50", "data=shapes_coco", "data.min_size=64", "data.max_size=96"]
    )
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    names = ["circle", "square", "triangle", "star", "cross", "ring"]
    export(
        Trained(cfg, model, tmp_path, 1, names, [1, 2, 3, 4, 5, 6]),
        "safetensors",
        tmp_path / "m.safetensors",
    )
    info = json.loads((tmp_path / "m.json").read_text())
    assert info["builder"] == "torchvision.models.detection.maskrcnn_resnet50_fpn"
    theirs = getattr(tvd, info["builder"].rsplit(".", 1)[1])(**info["kwargs"]).eval()
    theirs.load_state_dict(load_file(tmp_path / "m.safetensors"), strict=True)
    # random weights: every box counts
    model.roi_heads.score_thresh = theirs.roi_heads.score_thresh = 0.0
    image = [torch.rand(3, 64, 80, generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        mine, out = model(image)[0], theirs(image)[0]
    assert len(mine["masks"]) > 0
    for key in ("boxes", "labels", "scores", "masks"):
        assert torch.equal(mine[key], out[key]), key


def test_a_packed_split_gives_the_trees_masks(masked_set, tmp_path):
    """COCO packed into shards (its annotation file beside them): the same targets, masks included,
    as the tree."""
    from visiondist.data.shards import ShardStore
    from visiondist.data.shards.pack import PackOptions
    from visiondist.data.shards.packed_coco import ShardCoco, pack_coco

    splits = {
        s: (masked_set / s, masked_set / "annotations" / f"instances_{s}.json")
        for s in ("train", "val")
    }
    pack_coco(
        splits,
        tmp_path / "packed",
        PackOptions(shard_mb=0.05, workers=1, progress=False),
        masked_set,
    )
    packed = ShardCoco(
        ShardStore(str(tmp_path / "packed"), cache_dir=str(tmp_path / "cache")),
        "train",
        train=True,
        masks=True,
    )
    tree = CocoDetection(*splits["train"], train=True, masks=True)
    assert len(packed) == len(tree)
    for i in (0, 5, len(tree) - 1):
        (a, ta), (b, tb) = packed[i], tree[i]
        assert torch.equal(a, b) and all(
            torch.equal(ta[k], tb[k]) for k in ("boxes", "labels", "masks")
        )
