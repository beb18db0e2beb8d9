"""`data.decode_on=device` on the CPU: the workers hand over JPEG bytes with the crop the loader
path would draw, the rank decodes them (libjpeg-turbo here, nvJPEG on a GPU:
tests/unit/test_gpu.py), and the batch equals the loader path's to one grey level (OpenCV resizes in
fixed point, the device in float); files the device cannot take are decoded in the workers and come
out exactly as on the loader path."""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from visiondist.data import build_classification_data
from visiondist.data.decode import jpeg_frame
from visiondist.data.device_decode import Encoded, EncodedBatch, read_encoded
from visiondist.data.transforms import to_device
from visiondist.data.workers import close_loaders


def _photo(name: str, size: tuple[int, int]) -> np.ndarray:
    from skimage import data

    image = getattr(data, name)()
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA)


def _write_jpeg(path: Path, rgb: np.ndarray, quality: int = 92) -> Path:
    cv2.imwrite(
        str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality]
    )
    return path


def test_the_header_says_what_the_device_can_decode(tmp_path):
    rgb = _photo("coffee", (120, 80))
    baseline = _write_jpeg(tmp_path / "a.jpg", rgb)
    Image.fromarray(rgb).save(tmp_path / "p.jpg", progressive=True, quality=90)
    Image.fromarray(rgb).convert("L").save(tmp_path / "g.jpg")
    Image.fromarray(rgb).convert("CMYK").save(tmp_path / "c.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(rgb).save(tmp_path / "r.jpg", exif=exif)
    Image.fromarray(rgb).save(tmp_path / "x.png")
    frame = jpeg_frame(baseline.read_bytes())
    assert (
        frame.height,
        frame.width,
        frame.components,
        frame.precision,
        frame.sof,
        frame.app1,
    ) == (80, 120, 3, 8, 0, False)
    assert jpeg_frame((tmp_path / "p.jpg").read_bytes()).sof == 2
    assert jpeg_frame((tmp_path / "c.jpg").read_bytes()).components == 4
    assert jpeg_frame((tmp_path / "x.png").read_bytes()) is None
    for name in ("a.jpg", "p.jpg", "g.jpg"):  # baseline, progressive, grey: the device decodes them
        assert isinstance(read_encoded(tmp_path / name), Encoded), name
    # CMYK, turned by EXIF, not a JPEG: decoded in the worker, upright
    for name in ("c.jpg", "r.jpg", "x.png"):
        image = read_encoded(tmp_path / name)
        assert isinstance(image, np.ndarray) and image.shape[2] == 3, name
    assert read_encoded(tmp_path / "r.jpg").shape[:2] == (120, 80)  # EXIF 6: turned upright
    truncated = tmp_path / "t.jpg"
    truncated.write_bytes(baseline.read_bytes()[:-200])
    with pytest.raises(OSError, match="truncated"):
        read_encoded(truncated)


def _tree(root: Path) -> Path:
    """Real photos at ImageNet's sizes in 5 classes, plus one PNG, one EXIF-rotated and one CMYK
    JPEG."""
    rng = np.random.default_rng(0)
    for name in ("astronaut", "coffee", "chelsea", "rocket", "camera"):
        folder = root / "train" / name
        folder.mkdir(parents=True)
        photo = _photo(name, (500, 420))
        photo = photo if photo.ndim == 3 else np.repeat(photo[..., None], 3, axis=2)
        for i in range(6):
            h, w = int(rng.integers(300, 400)), int(rng.integers(380, 480))
            _write_jpeg(
                folder / f"{i}.jpg", np.ascontiguousarray(photo[:h, :w]), int(rng.integers(90, 96))
            )
    odd = root / "train" / "coffee"
    Image.open(odd / "0.jpg").save(odd / "png.png")
    exif = Image.Exif()
    exif[0x0112] = 8
    Image.open(odd / "1.jpg").save(odd / "exif8.jpg", exif=exif)
    Image.open(odd / "2.jpg").convert("CMYK").save(odd / "cmyk.jpg")
    shutil.copytree(root / "train", root / "val")
    return root


def _cfg(root: Path, **extra):
    return OmegaConf.create(
        {
            **dict(
                name="photos",
                root=str(root),
                train_split="train",
                val_split="val",
                num_classes=5,
                batch_size=33,
                eval_batch_size=33,
                num_workers=0,
                mean=[0.5] * 3,
                std=[0.25] * 3,
                train_crop_scale=[0.08, 1.0],
                hflip=0.5,
                crop_pct=0.875,
                interpolation="bilinear",
                auto_augment="rand",
                augment_on="device",
                random_erasing=0.25,
                random_erasing_mode="pixel",
                decode_on="loader",
                max_bad_images=3,
            ),
            **extra,
        }
    )


@pytest.mark.smoke  # torchvision 0.26's decode_jpeg (the GPU machines') as well as the newest
@pytest.mark.parametrize("workers", [0, 2])
def test_device_decoding_gives_the_loader_paths_batch(tmp_path, workers):
    """Every training image of the tree (33, three the device cannot take) in one batch, both paths,
    2 epochs: the same crops, flips and augmentation rows; pixels within one grey level (the
    decoders agree exactly on the CPU; OpenCV's fixed-point resize and the device's float one differ
    by rounding); the worker-decoded samples identical. With 2 workers the batch goes through the
    workers' shared memory, as the shipped settings send it."""
    # OpenCV resized with its thread pool here, before the workers fork (the loaders cope)
    root = _tree(tmp_path)
    try:
        _compare_paths(root, workers)
    finally:
        close_loaders()  # workers ignore SIGTERM: a rank ends them itself


def _compare_paths(root: Path, workers: int) -> None:
    for epoch in (0, 1):
        out = {}
        for decode_on in ("loader", "device"):
            data = build_classification_data(
                _cfg(root, decode_on=decode_on, num_workers=workers), 96, 0, 1, 1, 0, False
            )
            data.train_sampler.set_epoch(epoch)
            images, labels, rows = next(iter(data.train_loader))
            out[decode_on] = (images, to_device(images, torch.device("cpu")), labels, rows)
        (_, a, labels_a, rows_a), (encoded, b, labels_b, rows_b) = out["loader"], out["device"]
        assert isinstance(encoded, EncodedBatch) and len(encoded) == 33
        # the PNG, the EXIF-turned and the CMYK file
        assert int((encoded.crops[:, 0] == 0).sum()) == 3
        assert torch.equal(labels_a, labels_b) and torch.equal(rows_a, rows_b)
        diff = (a.int() - b.int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.25, (
            int(diff.max()),
            float((diff > 0).float().mean()),
        )
        in_worker = (encoded.crops[:, 0] == 0).nonzero().flatten()
        assert torch.equal(a[in_worker], b[in_worker])
        flipped = encoded.crops[:, 5] > 0
        assert 0 < int(flipped.sum()) < 33


def test_decode_on_device_needs_device_augmentation_and_an_image_folder():
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    configs = Path(__file__).resolve().parents[2] / "configs"
    with pytest.raises(ConfigError, match="use data.augment_on=device"):
        load_config(
            configs,
            ["data.decode_on=device", "data.augment_on=loader", "data.auto_augment=rand"],
            inputs=None,
        )
    with pytest.raises(ConfigError, match="use data.decode_on=loader"):
        load_config(configs, ["data=shapes_coco", "data.decode_on=device"], inputs=None)


def test_a_torchcodec_that_cannot_decode_on_the_device_gives_way_to_torchvision(monkeypatch):
    """TorchCodec's PyPI wheel decodes on the CPU only: where its decoder fails on a device (checked
    once, on a tiny JPEG), torchvision's decodes there and the log and summary name it."""
    from torchvision.io import decode_jpeg, encode_jpeg

    from visiondist.data import device_decode

    calls = []

    def no_decoder_here(data, mode, device):
        calls.append(device)
        raise RuntimeError("not built with this device")

    monkeypatch.setattr(device_decode, "_torchcodec_import", lambda: no_decoder_here)
    device_decode._torchcodec_decode.cache_clear()
    try:
        image = torch.randint(0, 256, (3, 16, 24), dtype=torch.uint8)
        data = encode_jpeg(image, quality=95)
        for _ in range(2):
            out = device_decode.decode_jpegs([data], torch.device("cpu"))
        assert calls == ["cpu"]  # checked once, not per batch
        assert torch.equal(out[0], decode_jpeg(data))
        assert device_decode.decoder_name(torch.device("cpu")) == "torchvision.io.decode_jpeg"
    finally:
        device_decode._torchcodec_decode.cache_clear()


def _encoded_batches(root: Path, count: int) -> list:
    """`count` loader batches of the tree's training images under decode_on=device (11 images
    each)."""
    data = build_classification_data(
        _cfg(root, decode_on="device", batch_size=11), 64, 0, 1, 1, 0, False
    )
    data.train_sampler.set_epoch(0)
    batches = iter(data.train_loader)
    return [next(batches) for _ in range(count)]


@pytest.mark.smoke  # the GPU machines' torch 2.11 as well as the newest
def test_decode_ahead_hands_over_the_batches_in_order_decoded_as_the_step_would(tmp_path):
    """On the CPU the thread and its hand-over run as on CUDA, with no stream or event to order:
    every batch comes in the source's order with the images the step's own decode gives; a batch
    object that comes twice (the benchmark's) is handed over twice, each time with images of its
    own; batches of pixels pass as they are."""
    from visiondist.data.decode_ahead import DecodeAhead

    batches = _encoded_batches(_tree(tmp_path), 3)
    cpu = torch.device("cpu")
    plain = (torch.zeros(2, 64, 64, 3, dtype=torch.uint8), torch.tensor([1, 2]))
    source = [batches[0], batches[1], plain, batches[2], batches[2]]
    with DecodeAhead(iter(source), cpu) as ahead:
        handed = list(ahead)
    assert len(handed) == 5 and handed[2] is plain
    for got, want in zip([handed[i] for i in (0, 1, 3, 4)], [batches[i] for i in (0, 1, 2, 2)]):
        assert got[0] is not want[0] and got[0].ready is not None and want[0].ready is None
        assert torch.equal(got[0].images(cpu), want[0].decode(cpu))
        # labels and augmentation rows
        assert all(torch.equal(a, b) for a, b in zip(got[1:], want[1:]))
    assert handed[3][0].images(cpu).data_ptr() != handed[4][0].images(cpu).data_ptr()


def test_decode_ahead_raises_the_sources_error_after_the_batches_before_it_and_closes_mid_epoch(
    tmp_path,
):
    from visiondist.data.decode_ahead import DecodeAhead

    batches = _encoded_batches(_tree(tmp_path), 2)

    def failing():
        yield from batches
        raise OSError("shard 3 is gone")

    ahead = DecodeAhead(failing(), torch.device("cpu"))
    assert [b[1].tolist() for b in (next(ahead), next(ahead))] == [b[1].tolist() for b in batches]
    with pytest.raises(OSError, match="shard 3 is gone"):
        next(ahead)
    with pytest.raises(StopIteration):
        next(ahead)

    # the loop stops mid-epoch
    endless = DecodeAhead(iter(lambda: batches[0], None), torch.device("cpu"))
    next(endless)
    endless.close()
    assert not endless._thread.is_alive()
    with pytest.raises(StopIteration):
        next(endless)


def test_evaluation_decodes_with_the_training_decoder_and_gives_the_loader_paths_batch(tmp_path):
    """Under data.decode_on=device the val split is decoded on the device too (one decoder per run:
    nvJPEG and OpenCV differ by up to 48 levels on real photos): the resize of the short side and
    the centre crop as torchvision's Resize and CenterCrop make them, timm's eval transform (sizes
    and offsets tested on a grid of shapes), the
    pixels within one grey level of the loader path's; the three files the device cannot take are
    decoded in the workers, identical."""
    import torchvision.transforms.functional as TF

    from visiondist.data.transforms import ClassificationTransform

    transform = ClassificationTransform(_cfg(tmp_path), train=False, size=224, seed=0)
    for h in range(230, 520, 13):
        for w in range(230, 620, 17):
            top, left, rh, rw = transform.transform.geometry(h, w)
            # torchvision's Resize(256) and CenterCrop(224): timm's eval transform
            assert tuple(TF.resize(torch.zeros(1, h, w), [256]).shape[1:]) == (rh, rw)
            corner = TF.center_crop(torch.arange(rh * rw).view(1, rh, rw), [224])[0, 0, 0]
            assert divmod(int(corner), rw) == (top, left)

    root = _tree(tmp_path)
    out = {}
    for decode_on in ("loader", "device"):
        data = build_classification_data(
            _cfg(root, decode_on=decode_on, num_workers=0), 96, 0, 1, 1, 0, False, train=False
        )
        images, labels = next(iter(data.val_loader))
        out[decode_on] = (images, to_device(images, torch.device("cpu")), labels)
    (_, a, labels_a), (encoded, b, labels_b) = out["loader"], out["device"]
    assert isinstance(encoded, EncodedBatch) and torch.equal(labels_a, labels_b)
    assert (
        set(encoded.crops[:, 0].tolist()) == {0.0, 2.0}
        and int((encoded.crops[:, 0] == 0).sum()) == 3
    )
    diff = (a.int() - b.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.25, (
        int(diff.max()),
        float((diff > 0).float().mean()),
    )
    in_worker = (encoded.crops[:, 0] == 0).nonzero().flatten()
    assert torch.equal(a[in_worker], b[in_worker])


def test_decode_on_auto_decodes_on_the_device_only_where_the_workers_cannot_feed_the_step():
    """data.decode_on=auto (visiondist.data.decode_choice): on an H100, a ViT-S/16 fed by 15 workers
    (a 16-core host) decodes in the workers, by 5 on the device; a ViT-B/16 needs 2 or fewer for the
    device; the CPU, COCO data and a GPU the peak table does not know stay in the loader; loader /
    device as asked; each choice says why, with figures."""
    from helpers import REPO

    from visiondist.cli import load_config
    from visiondist.config.layout import RunLayout
    from visiondist.data.decode_choice import decode_plan

    h100, gpu = "NVIDIA H100 80GB HBM3", RunLayout("cuda", 1, 1, 1)

    def choice(*extra, run=gpu, name=h100):
        cfg = load_config(
            REPO / "configs", ["data.num_classes=10", "data.img_size=224", *extra], inputs=None
        )
        return decode_plan(cfg, run, name)

    assert load_config(REPO / "configs", [], inputs=None).data.decode_on == "auto"
    for workers, expected in ((15, "loader"), (6, "loader"), (5, "device"), (0, "device")):
        got, why = choice(
            "model=vit_small", "trainer.precision=bf16", f"data.num_workers={workers}"
        )
        assert got == expected, (workers, why)
        assert f"{workers} loader worker" in why and "images/s" in why
    assert choice("model=vit_base", "trainer.precision=bf16", "data.num_workers=3")[0] == "loader"
    assert choice("model=vit_base", "trainer.precision=bf16", "data.num_workers=2")[0] == "device"
    assert (
        choice("model=vit_small", "data.num_workers=0", run=RunLayout("cpu", 1, 1, 1))[0]
        == "loader"
    )
    assert "unknown" in choice("model=vit_small", "data.num_workers=0", name="Some Future GPU")[1]
    assert (
        choice("model=fasterrcnn_mobilenet_v3", "data=shapes_coco", "data.num_workers=0")[0]
        == "loader"
    )
    assert choice("model=vit_small", "data.decode_on=device", "data.num_workers=15") == (
        "device",
        "data.decode_on=device",
    )
    assert choice("model=vit_small", "data.decode_on=loader", "data.num_workers=0")[0] == "loader"
