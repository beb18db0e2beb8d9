"""One reader for every loader: the classification and the COCO datasets decode the same odd files
(grey, RGBA, palette, CMYK, 16-bit PNG and TIFF, EXIF-rotated JPEG, PNG and TIFF, WebP, 1x1) to the
same, expected pixels; a COCO image whose upright size is not the annotation file's is an error
naming it; the export records the policy."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from visiondist.data.coco import CocoDetection, ImageSizeMismatch
from visiondist.data.decode import read_rgb
from visiondist.data.imagefolder import ImageFolder

RED, BLUE = (255, 0, 0), (0, 0, 255)
# the EXIF files' pixels as stored: 32 wide, 16 high, blue ...
STORED = np.zeros((16, 32, 3), np.uint8)
STORED[:] = BLUE
STORED[:8, :8] = RED  # ... with a red 8 x 8 block in the stored top-left corner
WEBP = np.random.default_rng(0).integers(0, 256, (4, 6, 3), dtype=np.uint8)


def _with_orientation(path: Path, orientation: int, **save) -> None:
    image = Image.fromarray(STORED)
    exif = image.getexif()
    exif[0x0112] = orientation
    image.save(path, exif=exif, **save)


def _write_odd_files(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("L", (5, 3), 77).save(folder / "grey.png")
    Image.new("RGBA", (5, 3), (10, 20, 30, 0)).save(folder / "rgba.png")  # fully transparent
    two = np.zeros((3, 6, 3), np.uint8)
    two[:, :3], two[:, 3:] = (200, 100, 50), (0, 128, 255)
    Image.fromarray(two).convert("P", palette=Image.Palette.ADAPTIVE, colors=2).save(
        folder / "palette.png"
    )
    Image.new("CMYK", (16, 16), (0, 255, 0, 0)).save(folder / "cmyk.jpg", quality=95)
    grey16 = np.array([[28784] * 4, [65535] * 4, [256] * 4], np.uint16)
    image = Image.fromarray(grey16)
    assert image.mode == "I;16"
    image.save(folder / "grey16.png")
    image.save(folder / "grey16.tif")
    _with_orientation(folder / "exif6.jpg", 6, quality=95, subsampling=0)
    _with_orientation(folder / "exif8.jpg", 8, quality=95, subsampling=0)
    _with_orientation(folder / "exif6.png", 6)
    Image.fromarray(STORED).save(folder / "exif6.tif", tiffinfo={0x0112: 6})
    Image.fromarray(WEBP).save(folder / "photo.webp", lossless=True)
    Image.new("RGB", (1, 1), (1, 2, 3)).save(folder / "one.png")


def _check_expected(name: str, image: np.ndarray) -> None:
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3, name
    if name == "grey.png":
        assert image.shape == (3, 5, 3) and (image == 77).all()
    elif name == "rgba.png":  # alpha dropped, not composited (on black this would be 0)
        assert (image == (10, 20, 30)).all()
    elif name == "palette.png":
        assert (image[:, :3] == (200, 100, 50)).all() and (image[:, 3:] == (0, 128, 255)).all()
    elif name == "cmyk.jpg":  # no cyan, full magenta: red + blue
        assert np.abs(image.astype(int) - (255, 0, 255)).max() <= 3
    # the high byte: 28784 -> 112, 65535 -> 255, 256 -> 1 (Pillow: 255, clipped)
    elif name.startswith("grey16"):
        assert (
            image[:, :, 0].tolist() == [[112] * 4, [255] * 4, [1] * 4]
            and (image == image[..., :1]).all()
        )
    # turned 90 degrees clockwise: 16 wide, 32 high, the red block top-right
    elif name.startswith("exif6"):
        assert image.shape == (32, 16, 3)
        assert np.abs(image[0, -1].astype(int) - RED).max() <= 8
        assert np.abs(image[0, 0].astype(int) - BLUE).max() <= 8
        assert np.abs(image[-1, -1].astype(int) - BLUE).max() <= 8
        if not name.endswith(".jpg"):
            assert np.array_equal(image, np.rot90(STORED, -1))
    elif name == "exif8.jpg":  # turned 90 degrees anticlockwise: the red block bottom-left
        assert image.shape == (32, 16, 3)
        assert np.abs(image[-1, 0].astype(int) - RED).max() <= 8
        assert np.abs(image[0, 0].astype(int) - BLUE).max() <= 8
    elif name == "photo.webp":
        assert np.array_equal(image, WEBP)
    elif name == "one.png":
        assert image.tolist() == [[[1, 2, 3]]]
    else:
        raise AssertionError(f"no expectation for {name}")


def _coco(folder: Path, sizes: dict[str, tuple[int, int]], path: Path) -> Path:
    """An annotation file over `folder`'s images with the given (width, height), one small box
    each."""
    names = sorted(sizes)
    data = {
        "images": [
            {"id": i, "file_name": n, "width": sizes[n][0], "height": sizes[n][1]}
            for i, n in enumerate(names, start=1)
        ],
        "annotations": [
            {
                "id": i,
                "image_id": i,
                "category_id": 1,
                "bbox": [0, 0, 1, 1],
                "area": 1,
                "iscrowd": 0,
            }
            for i in range(1, len(names) + 1)
        ],
        "categories": [{"id": 1, "name": "thing"}],
    }
    path.write_text(json.dumps(data))
    return path


def test_classification_and_coco_loaders_decode_odd_files_alike(tmp_path):
    folder = tmp_path / "val" / "odd"
    _write_odd_files(folder)
    names = sorted(p.name for p in folder.iterdir())
    assert len(names) == 12

    classification = ImageFolder(tmp_path / "val", train=False)
    by_folder = {
        Path(path).name: classification[i][0] for i, (path, _) in enumerate(classification.samples)
    }
    assert sorted(by_folder) == names

    upright = {n: (a.shape[1], a.shape[0]) for n, a in by_folder.items()}  # what an annotator saw
    for train in (False, True):
        coco = CocoDetection(folder, _coco(folder, upright, tmp_path / "ann.json"), train=train)
        by_coco = {
            r.path.name: coco[i][0].permute(1, 2, 0).numpy() for i, r in enumerate(coco.records)
        }
        assert sorted(by_coco) == names
        for name in names:
            assert np.array_equal(by_coco[name], by_folder[name]), name
    for name in names:
        _check_expected(name, by_folder[name])
    # what docs/checkpoints.md says: Pillow decodes the 8-bit files as the run does once their
    # orientation is applied
    for name in (
        "grey.png",
        "rgba.png",
        "palette.png",
        "exif6.jpg",
        "exif8.jpg",
        "exif6.png",
        "exif6.tif",
        "photo.webp",
        "one.png",
    ):
        with Image.open(folder / name) as im:
            pillow = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
        assert np.array_equal(pillow, read_rgb(folder / name)), name


def test_coco_image_whose_upright_size_is_not_the_annotations_is_an_error(tmp_path):
    folder = tmp_path / "img"
    folder.mkdir()
    _with_orientation(folder / "phone.jpg", 6, quality=95)
    Image.new("RGB", (40, 30)).save(folder / "plain.png")
    # not upright
    stored = _coco(folder, {"phone.jpg": (32, 16), "plain.png": (40, 30)}, tmp_path / "stored.json")
    for train in (True, False):  # never replaced in training: its boxes would be misplaced
        data = CocoDetection(folder, stored, train=train)
        with pytest.raises(
            ImageSizeMismatch,
            match=r"phone\.jpg reads as 16x32 \(upright\) but stored\.json says "
            r"image 1 is 32x16: its EXIF orientation turns it by 90 degrees",
        ):
            data[0]
        assert data[1][0].shape == (3, 30, 40)
    wrong = _coco(folder, {"phone.jpg": (16, 32), "plain.png": (50, 30)}, tmp_path / "wrong.json")
    data = CocoDetection(folder, wrong, train=False)
    assert data[0][0].shape == (3, 32, 16)
    with pytest.raises(
        ImageSizeMismatch, match=r"plain\.png reads as 40x30 .* is 50x30: fix the annotation file"
    ):
        data[1]


def test_export_records_the_decode_policy():
    from helpers import REPO

    from visiondist.checkpoint.export.preprocessing import sidecar
    from visiondist.checkpoint.export.trained import Trained
    from visiondist.cli import load_config

    cfg = load_config(REPO / "configs", ["model.depth=1", "model.num_heads=2"], inputs=None)
    info = json.loads(
        json.dumps(sidecar(Trained(cfg, None, Path("run/checkpoints/step_1"), 1, ["a"] * 6)))
    )
    assert info["decode"]["exif_orientation"].startswith("applied")
    assert "value >> 8" in info["decode"]["16_bit"] and info["decode"]["alpha"].startswith(
        "dropped"
    )
    assert info["decode"]["reader"] == "visiondist.data.decode.read_rgb"
