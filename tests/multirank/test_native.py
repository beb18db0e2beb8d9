"""data.resolution=native from the command line: images of mixed aspect ratios (the built-in set
with data.synthetic.max_aspect) trained at their own shapes on 1 and 2 ranks and under tp2, stopped
and continued, evaluated by tools/eval.py on 2 ranks, exported for timm's NaFlexVit."""

import json

import pytest
from helpers import REPO, TINY_DATA, assert_same_training, evals_of, losses_of, run_cli, train_ok

# patch 8 on 32 px images: the square model's 16 tokens, sequences of 8, 16 and 32; images from 3:1
# to 1:3
NATIVE = [
    *TINY_DATA,
    "data.synthetic.max_aspect=3",
    "model.patch_size=8",
    "model.num_heads=2",
    "data.resolution=native",
    "data.batch_size=8",
    "trainer.max_steps=4",
    "trainer.eval_every=2",
    "trainer.log_every=1",
    "trainer.accelerator=cpu",
    "trainer.loggers=[csv]",
]


@pytest.fixture(scope="module")
def native_reference(tmp_path_factory):
    """The one-process run every layout must reproduce, and its data."""
    root = tmp_path_factory.mktemp("native")
    run = root / "reference"
    out = train_ok(
        *NATIVE, f"data.root={root / 'data'}", f"trainer.run_dir={run}", "trainer.devices=1"
    )
    assert "native resolution" in out, out[-3000:]
    return root / "data", run


def test_a_native_run_on_2_ranks_stopped_and_continued_is_the_one_process_run(
    tmp_path, native_reference
):
    data, reference = native_reference
    run = tmp_path / "run"
    args = [
        *NATIVE,
        f"data.root={data}",
        f"trainer.run_dir={run}",
        "parallel.dp=2",
        "data.num_workers=2",
    ]
    train_ok(*args, "trainer.stop_at_step=2")
    assert sorted(losses_of(run)) == [1, 2]
    out = train_ok(*args)
    assert "resumed from" in out
    assert_same_training(reference, run)  # the losses, both evaluations and the final weights

    # tools/eval.py on 2 ranks scores the val set as the run did at its end, to the last digit
    evaluated = run_cli(
        [f"run_dir={run}", "trainer.devices=2"], timeout=300, script=REPO / "tools" / "eval.py"
    )
    assert evaluated.returncode == 0, evaluated.stdout[-3000:]
    stats = json.loads((next((run / "eval").iterdir()) / "eval.json").read_text())
    ((loss, top1),) = [v for s, v in evals_of(run, "val_loss", "val_top1").items() if s == 4]
    assert stats["val_loss"] == pytest.approx(loss, rel=1e-6) and stats["val_top1"] == top1
    # both say how the images were read, with the defaults resolved (config.yaml keeps them as
    # asked: -1 / null)
    assert stats["resolution"].startswith("native") and stats["val patches per image"] == 16, stats
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["train sequence lengths (patches)"] == [8, 16, 32]
        and summary["val patches per image"] == 16
    )
    assert summary["packed"] is False and summary["resolution"] == stats["resolution"]
    # at another length, as a user compares them: the same images read at 32 patches each
    longer = run / "eval_32"
    evaluated = run_cli(
        [f"run_dir={run}", "data.native.eval_seq_len=32", f"trainer.run_dir={longer}"],
        timeout=300,
        script=REPO / "tools" / "eval.py",
    )
    assert evaluated.returncode == 0, evaluated.stdout[-3000:]
    at_32 = json.loads((longer / "eval.json").read_text())
    assert at_32["val patches per image"] == 32 and at_32["val_count"] == stats["val_count"]
    assert at_32["val_loss"] != stats["val_loss"]
    # its log line says so
    assert "read native at 32 patches an image" in evaluated.stdout, evaluated.stdout[-2000:]


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tp=2"],
        ["parallel.tp=2", "parallel.sequence_parallel=true"],
        ["parallel.dp=2", "parallel.fsdp=true"],
    ],
    ids=["tp2", "tp2-sp", "fsdp2"],
)
def test_a_native_run_under_tp_sp_and_fsdp_trains_as_one_process(
    tmp_path, native_reference, layout
):
    """Heads split over 2 ranks (and with SP the masked sequences' tokens), or the weights sharded:
    the same losses, evaluations and weights."""
    data, reference = native_reference
    run = tmp_path / "run"
    out = train_ok(*NATIVE, f"data.root={data}", f"trainer.run_dir={run}", *layout)
    assert ("tp=2" if "parallel.tp=2" in layout else "fsdp") in out.lower()
    assert_same_training(reference, run)
    if layout == ["parallel.tp=2"]:  # its checkpoint's shards exported whole, for timm's NaFlexVit
        from safetensors.torch import load_file

        timm = pytest.importorskip("timm")
        out = tmp_path / "naflex.safetensors"
        exported = run_cli(
            [f"run_dir={run}", "format=naflex", f"out={out}"],
            timeout=300,
            script=REPO / "tools" / "export.py",
        )
        assert exported.returncode == 0, exported.stdout[-3000:]
        info = json.loads(out.with_suffix(".json").read_text())
        timm.create_model(info["timm_model"], pretrained=False, **info["kwargs"]).load_state_dict(
            load_file(out)
        )


def test_the_export_loads_in_timms_naflexvit_and_predicts_what_the_run_does(
    tmp_path, native_reference
):
    import torch
    from safetensors.torch import load_file

    timm = pytest.importorskip("timm")
    from visiondist.checkpoint.export.trained import load_trained
    from visiondist.models.patches import pack

    _, run = native_reference
    out = tmp_path / "naflex.safetensors"
    exported = run_cli(
        [f"run_dir={run}", "format=naflex", f"out={out}"],
        timeout=300,
        script=REPO / "tools" / "export.py",
    )
    assert exported.returncode == 0, exported.stdout[-3000:]
    assert "trained at native resolution" not in exported.stdout
    # the default export of a native run: the square model, and one line pointing to naflex
    square = run_cli(
        [f"run_dir={run}", f"out={tmp_path / 'square.safetensors'}"],
        timeout=300,
        script=REPO / "tools" / "export.py",
    )
    assert square.returncode == 0, square.stdout[-3000:]
    assert "the run trained at native resolution; this is the square model (" in square.stdout
    assert "format=naflex exports it for images at their own size" in square.stdout
    info = json.loads(out.with_suffix(".json").read_text())
    model = timm.create_model(info["timm_model"], pretrained=False, **info["kwargs"]).eval()
    model.load_state_dict(load_file(out), strict=True)
    trained = load_trained(run).model.eval()
    g = torch.Generator().manual_seed(0)
    images = [torch.randn(3, h, w, generator=g) for h, w in ((16, 48), (32, 32), (56, 16))]
    batch = pack(images, 8, 16)
    coords = torch.zeros(3, 16, 2, dtype=torch.long)
    for i, image in enumerate(images):
        rows, cols = image.shape[1] // 8, image.shape[2] // 8
        coords[i, : rows * cols] = torch.stack(
            torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), -1
        ).reshape(-1, 2)
    with torch.no_grad():
        want = trained(batch)
        got = model(
            {"patches": batch.patches, "patch_coord": coords, "patch_valid": batch.segments > 0}
        )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_native_run_predicts_new_images_as_its_evaluation_scored_them(tmp_path, native_reference):
    """tools/predict.py on the val folder of a native run: each image at its own shape, as the
    evaluation read it; the top-1 labels score exactly the run's final val top-1."""
    from pathlib import Path

    data, run = native_reference
    out = tmp_path / "predicted"
    printed = run_cli(
        [
            f"run_dir={run}",
            f"source={data / 'val'}",
            f"out={out}",
            "save_images=0",
            "batch=4",
            "trainer.progress=false",
            "trainer.devices=2",
        ],
        timeout=300,
        script=REPO / "tools" / "predict.py",
    )
    assert printed.returncode == 0, printed.stdout[-3000:]
    assert (
        json.loads((out / "predict.json").read_text())["images read"]
        == "native at 16 patches an image"
    )
    table = [line.split(",") for line in (out / "predictions.csv").read_text().splitlines()[1:]]
    assert len(table) == 30
    correct = sum(Path(r[0]).parts[0] == r[1] for r in table)
    ((top1,),) = [v for s, v in evals_of(run, "val_top1").items() if s == 4]
    assert 100.0 * correct / len(table) == pytest.approx(top1, abs=1e-9)

    # each image's probability as the evaluation's loader and the model give it (a square crop gives
    # others)
    want = {name: prob for name, (_, prob) in _evaluation_reading(data, run).items()}
    assert {r[0]: float(r[2]) for r in table} == pytest.approx(want, abs=1e-5)


def _evaluation_reading(data, run) -> dict:
    """val image (relative path) -> (top class index, its probability), each image read by the
    evaluation's loader (`NativeTransform`, `NativeCollate`, `Normalize`) at the run's length (16
    patches) and given to the run's model."""
    from pathlib import Path

    import torch
    from omegaconf import OmegaConf

    from visiondist.checkpoint.export.trained import load_trained
    from visiondist.data.imagefolder import ImageFolder
    from visiondist.data.native import NativeCollate, NativeTransform
    from visiondist.data.transforms import Normalize

    cfg = OmegaConf.load(run / "config.yaml")
    val = ImageFolder(data / "val", NativeTransform(cfg.data, False, 8, 0, 16))
    model = load_trained(run).model.eval()
    with torch.no_grad():
        batch = NativeCollate(8, [16])([val[i] for i in range(len(val))])[0]
        probs, top = (
            model(Normalize(cfg.data.mean, cfg.data.std)(batch, torch.device("cpu")))
            .softmax(1)
            .max(1)
        )
    return {
        str(Path(name).relative_to(data / "val")): (int(k), float(p))
        for (name, _), k, p in zip(val.samples, top, probs)
    }


def test_the_docs_timm_code_reads_an_image_as_the_run_did(tmp_path, native_reference):
    """The python block of docs/native-resolution.md ("Export and prediction"), run on the run's
    naflex export and on the val images of the most elongated shapes (each resized to its grid, most
    of them shrunk): the class and probability it prints are the run's evaluation's, to 1e-5."""
    import contextlib
    import io
    import re

    pytest.importorskip("timm")
    data, run = native_reference
    out = tmp_path / "model_naflex.safetensors"
    exported = run_cli(
        [f"run_dir={run}", "format=naflex", f"out={out}"],
        timeout=300,
        script=REPO / "tools" / "export.py",
    )
    assert exported.returncode == 0, exported.stdout[-3000:]
    docs = (REPO / "docs" / "native-resolution.md").read_text()
    code = re.search(r"## Export and prediction.*?```python\n(.*?)```", docs, re.S).group(1)
    assert '"model_naflex.safetensors"' in code and '"photo.jpg"' in code
    from PIL import Image

    reading = _evaluation_reading(data, run)
    sizes = {name: Image.open(data / "val" / name).size for name in reading}
    elongated = sorted(sizes, key=lambda n: max(sizes[n]) / min(sizes[n]))[-4:]
    assert all(max(sizes[n]) / min(sizes[n]) >= 2 for n in elongated), sizes
    classes = json.loads(out.with_suffix(".json").read_text())["classes"]
    for name in elongated:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(
                code.replace('"model_naflex.safetensors"', repr(str(out))).replace(
                    '"photo.jpg"', repr(str(data / "val" / name))
                ),
                {},
            )
        label, prob = printed.getvalue().split()
        want_class, want_prob = reading[name]
        assert label == classes[want_class] and float(prob) == pytest.approx(want_prob, abs=1e-5), (
            name,
            sizes[name],
        )


def test_a_square_runs_weights_continue_native_and_back(tmp_path, native_reference):
    """The same tensors either way: a square run's model.safetensors starts a native run
    (model.weights=), whose step-0 evaluation is tools/eval.py's native evaluation of that file; a
    native run's starts a square one alike."""
    data, _ = native_reference
    args = [*NATIVE, f"data.root={data}", "trainer.eval_at_start=true", "trainer.max_steps=2"]
    plain = [a for a in args if a != "data.resolution=native"]
    square, native, back = tmp_path / "square", tmp_path / "native", tmp_path / "back"
    train_ok(*plain, f"trainer.run_dir={square}")
    train_ok(*args, f"trainer.run_dir={native}", f"model.weights={square / 'model.safetensors'}")
    train_ok(*plain, f"trainer.run_dir={back}", f"model.weights={native / 'model.safetensors'}")
    for run, weights, settings in ((native, square, args), (back, native, plain)):
        out = tmp_path / f"eval_{run.name}"
        keep = [a for a in settings if a.startswith(("data.", "model."))]
        evaluated = run_cli(
            [f"weights={weights / 'model.safetensors'}", *keep, f"trainer.run_dir={out}"],
            timeout=300,
            script=REPO / "tools" / "eval.py",
        )
        assert evaluated.returncode == 0, evaluated.stdout[-3000:]
        stats = json.loads((out / "eval.json").read_text())
        ((loss, top1),) = [v for s, v in evals_of(run, "val_loss", "val_top1").items() if s == 0]
        assert stats["val_loss"] == pytest.approx(loss, rel=1e-6) and stats["val_top1"] == top1, (
            run.name
        )
        assert stats["resolution"] == (
            "square, 32 px" if settings is plain else "native (each image at its own aspect ratio)"
        ), stats
    # the images read another way
    assert evals_of(native, "val_loss")[0] != evals_of(square, "val_loss")[2]


def test_a_packed_native_run_on_2_ranks_is_the_one_process_run(tmp_path, native_reference):
    """data.native.pack=true: images of drawn sizes packed several to a sequence, attention inside
    each; 2 ranks (with loader workers) train as one process."""
    data, _ = native_reference
    packed = [*NATIVE, f"data.root={data}", "data.native.pack=true"]
    one, two = tmp_path / "one", tmp_path / "two"
    out = train_ok(*packed, f"trainer.run_dir={one}", "trainer.devices=1")
    assert "several images to a sequence (data.native.pack)" in out
    train_ok(*packed, f"trainer.run_dir={two}", "parallel.dp=2", "data.num_workers=2")
    assert_same_training(one, two)
