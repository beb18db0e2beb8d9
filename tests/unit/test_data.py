"""Built-in data is real, deterministic image files; the ImageFolder loader reads them with seeded
augmentation."""

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import REPO
from PIL import Image

from visiondist.config import compose
from visiondist.data import build_classification_data
from visiondist.data.imagefolder import ImageFolder, read_rgb
from visiondist.synthetic.shapes import SHAPE_CLASSES, ensure_shapes


def _digest(root):
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*.jpg"))
    }


def test_shapes_are_deterministic_jpeg_files(tmp_path, tiny_shapes):
    syn = SimpleNamespace(train_per_class=16, val_per_class=5, image_size=32, seed=0)
    again = ensure_shapes(tmp_path / "again", syn)
    assert _digest(again) == _digest(tiny_shapes)
    files = list((tiny_shapes / "train").rglob("*.jpg"))
    assert len(files) == 16 * len(SHAPE_CLASSES) >= 6 * 16
    with Image.open(files[0]) as im:
        assert im.format == "JPEG" and im.size == (32, 32)
    assert sorted(p.name for p in (tiny_shapes / "val").iterdir()) == sorted(SHAPE_CLASSES)


def test_a_different_spec_is_refused_not_overwritten(tiny_shapes):
    syn = SimpleNamespace(train_per_class=17, val_per_class=5, image_size=32, seed=0)
    with pytest.raises(
        ValueError,
        match="add data.synthetic.train_per_class=16 to read it as it is, or point "
        r"data.root elsewhere \(or delete that folder\)",
    ):
        ensure_shapes(tiny_shapes, syn)


def test_read_rgb_converts_grey_and_rgba(tmp_path):
    Image.fromarray(np.full((8, 9), 77, np.uint8), "L").save(tmp_path / "g.png")
    Image.fromarray(np.full((8, 9, 4), 200, np.uint8), "RGBA").save(tmp_path / "a.png")
    Image.new("CMYK", (9, 8), (0, 255, 0, 0)).save(tmp_path / "c.jpg")
    for name, value in (("g.png", 77), ("a.png", 200), ("c.jpg", None)):
        img = read_rgb(str(tmp_path / name))
        assert img.shape == (8, 9, 3) and img.dtype == np.uint8
        assert value is None or (img == value).all()
    (tmp_path / "bad.jpg").write_bytes(b"not an image")
    with pytest.raises(OSError, match="bad.jpg"):
        read_rgb(str(tmp_path / "bad.jpg"))


def _jpeg(path, value):
    Image.fromarray(np.full((32, 32, 3), value, np.uint8)).save(path, quality=95)


def test_unreadable_training_images_are_replaced_within_their_class(tmp_path, caplog):
    """Empty, truncated, missing and non-image files: each is replaced by the next readable image of
    the same class (labels unchanged), the first one logged; a run of max_bad_images is an error; in
    evaluation any is an error."""
    import logging

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    _jpeg(tmp_path / "a" / "0.jpg", 10)
    (tmp_path / "a" / "1.jpg").write_bytes(b"")  # zero bytes
    _jpeg(tmp_path / "a" / "2.jpg", 20)
    data = (tmp_path / "a" / "2.jpg").read_bytes()
    # truncated (OpenCV alone would decode it)
    (tmp_path / "a" / "2.jpg").write_bytes(data[: len(data) // 2])
    _jpeg(tmp_path / "a" / "3.jpg", 40)
    _jpeg(tmp_path / "b" / "0.jpg", 90)
    _jpeg(tmp_path / "b" / "1.jpg", 99)
    (tmp_path / "b" / "2.jpg").write_bytes(b"<html>not found</html>")
    train = ImageFolder(tmp_path, train=True, max_bad_images=3)
    (tmp_path / "b" / "1.jpg").unlink()  # gone after the folder was scanned
    with caplog.at_level(logging.WARNING):
        got = [train[i] for i in range(len(train))] + [train[1]]
    values = [int(np.median(image)) for image, _ in got]
    labels = [label for _, label in got]
    assert labels == [0, 0, 0, 0, 1, 1, 1, 0]
    assert abs(values[1] - 40) <= 2 and abs(values[2] - 40) <= 2  # a/1 and a/2 -> a/3
    # b/1 and b/2 wrap round to b/0, not to class a
    assert abs(values[5] - 90) <= 2 and abs(values[6] - 90) <= 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # each unreadable file once, a/1 though read twice
    named = ["a/1.jpg", "a/2.jpg", "b/1.jpg", "b/2.jpg"]
    assert [next(n for n in named if n in w) for w in warnings] == named, warnings
    assert "the file is empty" in warnings[0] and all(
        "each unreadable file is named once" in w for w in warnings
    )

    with pytest.raises(RuntimeError, match="2 consecutive images from index 1 could not be read"):
        ImageFolder(tmp_path, train=True, max_bad_images=2)[1]
    with pytest.raises(RuntimeError, match="cannot read evaluation image .*a/1.jpg"):
        ImageFolder(tmp_path)[1]


def test_unreadable_images_are_warned_once_per_run_and_each_listed(tmp_path, caplog, monkeypatch):
    """Two loader workers of one run (two copies of the data set) meet three bad files: one warning
    for each file in all, bad_images.txt lists each file once with its reason, and the summary's
    count says 3."""
    import logging

    from visiondist.data.robust import count_bad_images
    from visiondist.utils.signals import RUN_DIR_ENV

    root, run = tmp_path / "data", tmp_path / "run"
    (root / "a").mkdir(parents=True)
    run.mkdir()
    for i in range(3):
        (root / "a" / f"{i}.jpg").write_bytes(b"")
    _jpeg(root / "a" / "3.jpg", 40)
    monkeypatch.setenv(RUN_DIR_ENV, str(run))
    workers = [ImageFolder(root, train=True, max_bad_images=5) for _ in range(2)]
    with caplog.at_level(logging.WARNING):
        for worker in workers:
            for i in range(3):
                worker[i]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split(" (")[0] for w in warnings] == [
        f"cannot read {root / 'a' / f'{i}.jpg'}" for i in range(3)
    ]
    listed = [line.split("\t") for line in (run / "bad_images.txt").read_text().splitlines()]
    assert sorted(listed) == [[str(root / "a" / f"{i}.jpg"), "the file is empty"] for i in range(3)]
    assert count_bad_images(run) == 3


def test_empty_class_folder_is_an_error(tmp_path, tiny_shapes):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "a" / "x.jpg")
    with pytest.raises(FileNotFoundError, match="holds no images"):
        ImageFolder(tmp_path)


def _data(tiny_shapes, dp_rank, dp, overrides=()):
    cfg = compose(
        REPO / "configs",
        [
            f"data.root={tiny_shapes}",
            "data.img_size=32",
            "data.batch_size=12",
            "data.num_workers=0",
            *overrides,
        ],
    )
    return build_classification_data(
        cfg.data, cfg.model.img_size, dp_rank, dp, grad_accum=1, seed=0, pin_memory=False
    ), cfg


def test_augmentation_depends_on_sample_and_epoch_only(tiny_shapes):
    """The same (index, epoch) gives the same pixels in any order, on any rank; another epoch
    differs."""
    data, _ = _data(tiny_shapes, 0, 1)
    ds = data.train_loader.dataset
    first = ds[(5, 0)][0]
    ds[(7, 0)], ds[(9, 3)]  # other samples in between
    assert torch.equal(ds[(5, 0)][0], first)
    assert not torch.equal(ds[(5, 1)][0], first)
    # made C, H, W and normalised on the device
    assert first.shape == (32, 32, 3) and first.dtype == torch.uint8


def test_device_normalisation_equals_normalising_in_the_loader(tiny_shapes):
    """The loader yields uint8 N, H, W, C; `Normalize` on the device gives what normalising float C,
    H, W pixels in the loader gave."""
    from visiondist.data.transforms import Normalize

    data, cfg = _data(tiny_shapes, 0, 1)
    images, _ = next(iter(data.train_loader))
    assert images.dtype == torch.uint8
    mean, std = (
        torch.tensor(cfg.data.mean).view(1, 3, 1, 1),
        torch.tensor(cfg.data.std).view(1, 3, 1, 1),
    )
    expected = (images.permute(0, 3, 1, 2).float() / 255 - mean) / std
    torch.testing.assert_close(
        Normalize(cfg.data.mean, cfg.data.std)(images, torch.device("cpu")), expected
    )


def test_loader_batches_and_class_count(tiny_shapes):
    data, cfg = _data(tiny_shapes, 1, 2)
    images, labels = next(iter(data.train_loader))
    # H, W, C: made C, H, W on the device
    assert images.shape == (6, 32, 32, 3) and labels.dtype == torch.int64
    assert data.classes == sorted(SHAPE_CLASSES) and data.num_val == 30
    with pytest.raises(ValueError, match="set data.num_classes=6"):
        _data(tiny_shapes, 0, 1, ["data.num_classes=10"])
