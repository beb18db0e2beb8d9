"""DETR-class detectors (visiondist/models/detr.py) in one process: the published sizes, the input
against the library's own image processor on real photographs, RT-DETR's multi-scale draw, weights
in the library's layout (a from_pretrained directory, a Hugging Face repo name from the local
cache), the ONNX graph, the config checks."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("transformers")

from helpers import assert_same_detections, sample_photos
from helpers import detr_model_cfg as _cfg

from visiondist.models.detr import ARCHS, DetrDetector
from visiondist.models.detr_library import build_detr, save_library_dir

# published parameter counts (the papers' and model cards' rounding) and what the built models have
# at 80 classes (the paper's millions of parameters, the count here: from random weights the
# backbone's BatchNorms train, so their scales and shifts count, as in the papers' own training)
PUBLISHED = {
    "rtdetr_v2_r18": (20, 20.18),
    "rtdetr_v2_r50": (42, 42.95),
    "dfine_n": (4, 3.78),
    "dfine_s": (10, 10.32),
    "rfdetr_nano": (30.5, 30.43),
    "rfdetr_small": (32.1, 32.07),
}


def _trained_like(model):
    """A fresh model in evaluation is degenerate: its encoder's features barely vary over an image
    (BatchNorms at their initial statistics, score heads at zero), so most queries tie and which of
    them top-k keeps is arbitrary. 10 AdamW steps on two photographs give it the spread of a trained
    model, with the BatchNorms' statistics averaged over the steps (momentum None): at the default
    momentum their initial variance of 1 would outweigh RT-DETR's encoder activations (variance
    ~1e-8 at the library's initialisation) for hundreds of steps, and its encoder would score every
    position the same to 1e-6. This way the encoder's scores at the edge of the kept queries differ
    by 1.5e-3 to 4e-2 over the three families (measured), far above float round-off."""
    from skimage import data

    torch.manual_seed(1)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.momentum = None
    images = [
        torch.from_numpy(getattr(data, n)()).permute(2, 0, 1).float() / 255
        for n in ("astronaut", "rocket")
    ]
    targets = [
        {
            "boxes": torch.tensor([[40.0, 30.0, 300.0, 400.0], [200.0, 50.0, 260.0, 120.0]]),
            "labels": torch.tensor([1, 2]),
        }
    ] * 2
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(10):
        model(images, targets)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


_TRAINED: dict = {}


def _trained(arch):
    """`_trained_like` of a fresh `arch` model at 128 px: trained once per process, a fresh copy
    each call."""
    if arch not in _TRAINED:
        torch.manual_seed(0)
        _TRAINED[arch] = {
            k: v.clone() for k, v in _trained_like(build_detr(_cfg(arch))).state_dict().items()
        }
    model = build_detr(_cfg(arch))
    model.load_state_dict(_TRAINED[arch])
    return model.eval()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_built_from_the_published_configs_with_their_sizes(arch):
    with torch.device("meta"):
        model = build_detr(_cfg(arch, num_classes=80, img_size=640, num_queries=None))
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    assert millions == pytest.approx(PUBLISHED[arch][1], abs=0.01)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_variant_trains_and_predicts_through_the_wrapper(arch):
    """One training step at 64 px (the variants share their family's code; this runs each one's own
    values), every trainable tensor given a gradient, then one detection per query for each image of
    any size, labels 1-based."""
    # the candidate positions at 64 px
    queries = {"dfine_n": 20, "rfdetr_nano": 16, "rfdetr_small": 16}.get(arch, 50)
    torch.manual_seed(0)
    model = build_detr(_cfg(arch, img_size=64, num_queries=queries))
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]
    targets = [
        {
            "boxes": torch.tensor([[4.0, 6.0, 40.0, 50.0]]),
            "labels": torch.tensor([3]),
            "image_id": 1,
        },
        {
            "boxes": torch.tensor([[10.0, 10.0, 30.0, 20.0], [0.0, 0.0, 64.0, 64.0]]),
            "labels": torch.tensor([1, 2]),
            "image_id": 2,
        },
    ]
    loss = model(images, targets)["loss"]
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    idle = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not idle, idle[:5]
    model.eval()
    with torch.no_grad():
        out = model([torch.rand(3, 48, 80), torch.rand(3, 90, 60)])
    for det in out:
        assert det["boxes"].shape == (queries, 4) and det["scores"].shape == det[
            "labels"
        ].shape == (queries,)
        assert 1 <= int(det["labels"].min()) and int(det["labels"].max()) <= 3


PHOTOS = ("astronaut", "coffee", "chelsea", "rocket")  # 512x512, 400x600, 300x451, 427x640


@pytest.mark.parametrize(
    "arch,side", [("rtdetr_v2_r18", 640), ("rtdetr_v2_r18", 320), ("rfdetr_nano", 384)]
)
def test_inputs_equal_the_library_image_processors_on_real_photos(arch, side):
    """What the model sees, by both paths: evaluation (the wrapper resizes the image as loaded) and
    training (the loader's worker resizes to the square, then the wrapper passes it on), against the
    model's own image processor (RT-DETR: resize antialiased when shrinking, no normalisation;
    RF-DETR: no antialias, ImageNet mean / std), up to rounding: the processor rounds its resize to
    uint8 (1 level = 1/255 before normalisation)."""
    import transformers
    from skimage import data

    from visiondist.data.transforms import resize_square

    spec = ARCHS[arch]
    detector = DetrDetector(torch.nn.Identity(), side, spec)
    processor = getattr(transformers, spec.processor)(size={"height": side, "width": side})
    # one uint8 level, in the model's input units
    level = 1 / 255 / (0.225 if spec.normalize else 1.0)
    for name in PHOTOS:
        photo = getattr(data, name)()
        want = processor(images=photo, return_tensors="pt")["pixel_values"][0]
        image = torch.from_numpy(photo).permute(2, 0, 1).float() / 255
        evaluated = detector.pixels([image])[0]
        assert (evaluated - want).abs().max() <= 1.01 * level, name
        square, boxes = resize_square(
            photo, np.array([[10, 20, 110, 220]], np.float32), side, spec.antialias
        )
        trained = detector.pixels([torch.from_numpy(square).permute(2, 0, 1).float() / 255])[0]
        # PIL / OpenCV vs torchvision: a level more
        assert (trained - want).abs().max() <= 2.01 * level, name
        assert (trained - want).abs().mean() <= 0.3 * level, name
        h, w = photo.shape[:2]
        assert boxes[0].tolist() == pytest.approx(
            [10 * side / w, 20 * side / h, 110 * side / w, 220 * side / h]
        )


def test_multi_scale_draws_one_size_per_batch_from_its_images():
    scales = [480, 512, 544, 576, 608, 640, 640, 640, 672, 704, 736, 768, 800]
    detector = DetrDetector(torch.nn.Identity(), 640, ARCHS["rtdetr_v2_r18"], scales)
    batches = [[{"image_id": i + 4 * b} for i in range(4)] for b in range(60)]
    drawn = [detector.input_size(t) for t in batches]
    assert set(drawn) <= set(scales) and len(set(drawn)) >= 8  # the whole range is drawn from
    # a batch's size depends only on its images: a
    assert drawn == [detector.input_size(t) for t in batches]
    assert drawn.count(640) > drawn.count(480)  # resumed run draws what the uninterrupted one did
    detector.eval()
    assert {detector.input_size(t) for t in batches} == {640}  # evaluation at img_size
    detector.train()
    images = [torch.rand(3, 640, 640) for _ in range(2)]
    assert detector.pixels(images, 512).shape == (2, 3, 512, 512)


def _hub_cache(root, repo, source):
    """huggingface_hub's cache layout holding `source`'s files as the snapshot of `repo` (what `hf
    download` leaves)."""
    import shutil

    entry = root / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(source / name, snapshot / name)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0" * 40)


@pytest.mark.timeout(600)  # as the ONNX test's
# on the ONNX test's worker: D-FINE-N trained once (`_trained`)
@pytest.mark.xdist_group("trained_dfine_n")
def test_weights_from_a_from_pretrained_directory_and_from_the_hub_cache(
    tmp_path, monkeypatch, caplog
):
    import transformers
    from huggingface_hub import constants
    from skimage import data

    from visiondist.utils.pretrained import WeightsNotFound

    torch.manual_seed(0)
    trained = _trained("dfine_n")
    files = save_library_dir(trained, tmp_path / "hf", ["circle", "square", "triangle"])
    assert [f.name for f in files] == [
        "config.json",
        "model.safetensors",
        "preprocessor_config.json",
    ]
    # transformers alone reads it: strictly, with the class names, and predicts what the run's model
    # does
    library, info = transformers.AutoModelForObjectDetection.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert not any(info.values()) and library.config.id2label == {
        0: "circle",
        1: "square",
        2: "triangle",
    }
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    # a photograph, as the BatchNorms' statistics are (random pixels sit far outside them)
    photo = data.chelsea()
    image = torch.from_numpy(photo).permute(2, 0, 1).float() / 255
    seen = {}
    hook = trained.model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.update(kwargs), with_kwargs=True
    )
    with torch.no_grad():
        ours = trained([image])[0]
    hook.remove()
    # the processor the directory ships prepares the photograph as the run's model does, to its
    # uint8 rounding (a barely trained detector's scores tie closely enough that this rounding alone
    # reorders its detections: the predictions are compared on one input)
    pixels = processor(images=photo, return_tensors="pt")["pixel_values"]
    assert pixels.shape == seen["pixel_values"].shape
    assert (pixels - seen["pixel_values"]).abs().max() <= 1.5 / 255
    with torch.no_grad():
        theirs = processor.post_process_object_detection(
            library.eval()(pixel_values=seen["pixel_values"]),
            threshold=0.0,
            target_sizes=[photo.shape[:2]],
        )[0]
    # transformers' labels count from 0, ours from 1 (background)
    theirs = {**theirs, "labels": theirs["labels"] + 1}
    assert len(ours["scores"]) == len(theirs["scores"])
    # the same network on the same input
    assert_same_detections(ours, theirs, box_atol=1e-3, score_atol=1e-5)

    # model.weights= the directory, or a repo name whose snapshot is in the cache: the same
    # predictions
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _hub_cache(tmp_path / "cache", "someone/dfine-n-shapes", tmp_path / "hf")
    for spec in (str(tmp_path / "hf"), "someone/dfine-n-shapes"):
        loaded = build_detr(_cfg("dfine_n", weights=spec)).eval()
        with torch.no_grad():
            again = loaded([image])[0]
        assert all(torch.equal(ours[k], again[k]) for k in ours), spec
    # another class count: the class heads start afresh, every other tensor is the file's, and the
    # log says so
    with caplog.at_level("INFO"):
        other = build_detr(_cfg("dfine_n", weights="someone/dfine-n-shapes", num_classes=5))
    assert "3 classes there, 5 here: the class heads" in caplog.text
    same = other.state_dict()["model.model.encoder_input_proj.0.0.weight"]
    assert torch.equal(same, trained.state_dict()["model.model.encoder_input_proj.0.0.weight"])
    # the wrong kind or variant, or a name not cached: one line naming the fix
    with pytest.raises(
        ValueError,
        match=r"holds a d_fine model, not model=rfdetr_nano's rf_detr: use model=dfine_n "
        r"or model=dfine_s",
    ):
        build_detr(_cfg("rfdetr_nano", weights="someone/dfine-n-shapes"))
    with pytest.raises(
        ValueError, match=r"is another variant than model=dfine_s .*: use model=dfine_n$"
    ):
        build_detr(_cfg("dfine_s", weights="someone/dfine-n-shapes"))
    with pytest.raises(
        WeightsNotFound,
        match=r"someone/absent is not in the cache .*HF_HUB_OFFLINE=1.*hf download "
        r"someone/absent config.json model.safetensors",
    ):
        build_detr(_cfg("dfine_n", weights="someone/absent"))


# ~25 s alone; several times that beside another worker's ranks on 2 cores
@pytest.mark.timeout(600)
@pytest.mark.xdist_group("trained_dfine_n")
@pytest.mark.parametrize("arch", ["rfdetr_nano", "dfine_n", "rtdetr_v2_r18"])
def test_onnx_graph_takes_a_batch_of_photos_of_any_size_and_equals_pytorch(arch, tmp_path):
    """The exported graph (images resized to the model's side and their original sizes -> every
    query's box, label, score) under ONNX Runtime against the PyTorch detector on each original
    alone: a batch of four real photographs of four sizes, then one alone (the batch is dynamic),
    every detection matched as tools/export.py's check matches them (near-tied scores may come out
    in another order)."""
    ort = pytest.importorskip("onnxruntime")

    from visiondist.checkpoint.export.onnx import _export_detr_onnx
    from visiondist.checkpoint.export.onnx_batch import detector_feed
    from visiondist.checkpoint.export.onnx_check import BOX_ROUND_OFF, _box_diff
    from visiondist.models.detr import DetrForExport

    torch.manual_seed(0)
    model = _trained(arch)
    _export_detr_onnx(model, tmp_path / "m.onnx", {"labels": json.dumps({"1": "a"})})
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_modelmeta().custom_metadata_map["labels"] == json.dumps({"1": "a"})
    # what a serving config or a runtime allocating its output buffers reads: K is the queries'
    assert [o.shape[1:] for o in session.get_outputs()] == [[20, 4], [20], [20], []]
    photos = sample_photos("coffee", "chelsea", "astronaut", "rocket")
    assert len({tuple(p.shape) for p in photos}) == 4
    resize = DetrForExport(model).resized
    for batch in (photos, photos[1:2]):
        images = torch.stack([resize(p) for p in batch]).numpy()
        sizes = np.array([p.shape[1:] for p in batch], dtype=np.int64)
        # what predict and eval feed the file (its `input` metadata): the same pixels
        given = {"images": "resized", "side": model.img_size, "antialias": model.arch.antialias}
        fed = detector_feed(given, batch)
        assert np.array_equal(fed["images"], images) and np.array_equal(fed["sizes"], sizes)
        boxes, labels, scores, count = session.run(None, {"images": images, "sizes": sizes})
        assert boxes.shape == (len(batch), 20, 4) and labels.shape == scores.shape
        assert count.tolist() == [20] * len(batch)
        for i, photo in enumerate(batch):
            with torch.no_grad():
                want = model([photo])[0]
            got = [boxes[i], labels[i], scores[i]]
            assert _box_diff([want["boxes"], want["labels"], want["scores"]], got) < BOX_ROUND_OFF


def _checked(overrides, data="shapes_coco"):
    from visiondist.config import ConfigError, compose
    from visiondist.models.registry import check_support

    cfg = compose(Path(__file__).resolve().parents[2] / "configs", [f"data={data}", *overrides])
    try:
        check_support(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


def test_config_checks_name_the_fix():
    assert _checked(["model=rfdetr_nano"]) is None
    assert _checked(["model=rtdetr_v2_r18"]) is None
    assert "model.img_size: 400 is not a multiple of 32" in _checked(
        ["model=rfdetr_nano", "model.img_size=400", "model.multi_scale=null"]
    )
    assert (
        "model.multi_scale=[480, 512, 544, 576, 608, 640, 640, 640, 672, 704, 736, 768, 800] does "
        "not hold model.img_size=320"
    ) in _checked(["model=rtdetr_v2_r18", "model.img_size=320"], data="coco")
    message = _checked(
        ["model=dfine_n", "model.img_size=128", "model.multi_scale=null", "model.num_queries=null"]
    )
    assert (
        "128 px gives dfine_n 80 candidate positions (strides 16, 32), fewer than its 300 "
        "queries: use >= 256 px or set model.num_queries=80" in message
    )
    assert "model.num_queries=0: give at least 1" in _checked(
        ["model=dfine_n", "model.num_queries=0"]
    )
    # sizes the library's feature pyramid cannot join (they failed at the first step with a
    # tensor-shape error)
    assert (
        "model.img_size: 170 is not a multiple of 32 (its stride-32 features are upsampled onto "
        "the finer ones for dfine_n): use 160"
    ) in _checked(["model=dfine_n", "model.img_size=170"])
    assert "model.multi_scale: 176 is not a multiple of 32" in _checked(
        ["model=rtdetr_v2_r18", "model.img_size=160", "model.multi_scale=[160,176]"]
    )
    assert "use parallel.tp=1 (parallel=ddp)" in _checked(["model=dfine_n", "parallel=tp2"])
    assert "is a detector: use DDP (parallel=ddp, or drop parallel.fsdp)" in _checked(
        ["model=dfine_n", "parallel.fsdp=true"]
    )
    assert "data.large_scale_jitter=true" in _checked(
        ["model=dfine_s", "data.large_scale_jitter=true"]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch,size", [("rtdetr_v2_r18", 640), ("dfine_n", 640), ("rfdetr_nano", 384)]
)
def test_each_family_at_its_published_input_trains_evaluates_and_runs_the_plain_loop(arch, size):
    """At the published input and the published 300 queries (RF-DETR-N at 384 px: 576 candidate
    positions), the benchmark's batch is the model's square, on which our step and the library's own
    plain loop both train (the plain loop was fed the data's 160-px squares, where RF-DETR-N's 100
    positions cannot give 300 queries), and evaluation returns one detection per query."""
    from visiondist.bench.measure import synthetic_batch
    from visiondist.models.detr import library_target
    from visiondist.models.detr_archs import build_hf_detector

    cfg = OmegaConf.create(
        {
            "model": {**_cfg(arch, img_size=size, num_queries=None), "family": "detr"},
            "data": {"min_size": 160},
        }
    )
    images, targets = synthetic_batch(cfg, "detection", 1, torch.device("cpu"))
    assert images[0].shape == (3, size, size)
    images = [im.float() / 255 for im in images]
    torch.manual_seed(0)
    model = build_detr(cfg.model).train()
    model(images, targets)["loss"].backward()
    # the plain loop's model, fed the same squares (a forward: the other two took 160 px)
    if arch == "rfdetr_nano":
        library = build_hf_detector(arch, 3).train()
        labels = [library_target(t, size, size) for t in targets]
        assert torch.isfinite(library(pixel_values=torch.stack(images), labels=labels).loss)
    with torch.no_grad():
        detections = model.eval()(images)
    assert detections[0]["boxes"].shape == (300, 4)


def test_detections_are_clipped_to_the_image_in_evaluation_and_export():
    """Boxes reaching past the border (the predicted sizes scaled 10x by a hook on the library's
    model) come back inside the image, as torchvision's detectors return theirs, from evaluation and
    from the exported function alike."""
    from visiondist.models.detr import DetrForExport

    model = _trained("dfine_n")

    def wider(_module, _inputs, out):
        out.pred_boxes = torch.cat([out.pred_boxes[..., :2], out.pred_boxes[..., 2:] * 10], dim=-1)
        return out

    model.model.register_forward_hook(wider)
    # the same image whatever ran before in this process
    image = torch.rand(3, 90, 150, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        raw = model.model(pixel_values=model.pixels([image]))
        evaluated = model([image])[0]["boxes"]
        exported = DetrForExport(model).eval()(
            DetrForExport(model).resized(image)[None], torch.tensor([[90, 150]])
        )[0][0]
    cx, w = raw.pred_boxes[0, :, 0], raw.pred_boxes[0, :, 2]
    assert bool(((cx + w / 2) > 1).any()), "the hook should push boxes past the border"
    for boxes in (evaluated, exported):
        assert float(boxes[:, 0::2].min()) >= 0 and float(boxes[:, 0::2].max()) <= 150
        assert float(boxes[:, 1::2].min()) >= 0 and float(boxes[:, 1::2].max()) <= 90
        assert float(boxes[:, 2].max()) == 150  # clipped, not dropped
    torch.testing.assert_close(
        evaluated.sort(dim=0).values, exported.sort(dim=0).values, rtol=1e-4, atol=1e-3
    )


def test_compile_model_compiles_the_library_network_the_loss_stays_eager():
    """trainer.compile=model for a DETR: the library's network (backbone, encoder, decoder) compiled
    whole (RF-DETR's in one graph, no break), the loss and its host matching eager; the compiled
    step's loss equals eager's. (aot_eager: what dynamo captures, without Inductor's minutes of CPU
    code generation.)"""
    from torch._dynamo.utils import counters

    from visiondist.parallel import compile_model

    torch.manual_seed(0)
    model = build_detr(_cfg("rfdetr_nano", img_size=64, num_queries=16)).train()
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]
    targets = [
        {
            "boxes": torch.tensor([[4.0, 6.0, 40.0, 50.0]]),
            "labels": torch.tensor([3]),
            "image_id": 1,
        },
        {
            "boxes": torch.tensor([[10.0, 10.0, 30.0, 20.0]]),
            "labels": torch.tensor([1]),
            "image_id": 2,
        },
    ]
    torch.manual_seed(1)  # the same draws (the library's dropout) in both steps
    eager = model(images, targets)["loss"]
    torch._dynamo.reset()
    counters.clear()
    compile_model(model, backend="aot_eager")
    torch.manual_seed(1)
    compiled = model(images, targets)["loss"]
    compiled.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(compiled, eager)
    assert (
        model.model.model._compiled_call_impl is not None
        and getattr(model, "_compiled_call_impl", None) is None
    )


def test_compile_plan_for_detr():
    """trainer.compile for a DETR: auto leaves it eager (not yet measured on a GPU), model / true
    compile the network whole, blocks and CUDA graphs are refused naming why."""
    from helpers import REPO

    from visiondist.cli import load_config
    from visiondist.config import ConfigError
    from visiondist.config.layout import RunLayout
    from visiondist.plan.compiling import compile_plan

    def plan(*extra):
        cfg = load_config(
            REPO / "configs", ["model=dfine_n", "data=shapes_coco", *extra], inputs=None
        )
        return compile_plan(cfg, RunLayout("cuda", 1, 1, 1))[:3]

    assert plan() == (False, "none", False)  # auto: eager until measured
    assert plan("trainer.compile=model") == (True, "model", False)
    assert plan("trainer.compile=true") == (True, "model", False)
    with pytest.raises(ConfigError, match="compile=model compiles its network"):
        plan("trainer.compile=blocks")
    with pytest.raises(ConfigError, match="cuda_graphs=true: dfine_n's denoising"):
        plan("trainer.compile=model", "trainer.cuda_graphs=true")
