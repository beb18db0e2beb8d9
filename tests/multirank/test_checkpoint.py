"""Checkpoints through `python tools/train.py`: an interrupted and resumed run equals an
uninterrupted one bit for bit; a checkpoint saved under one layout resumes under another; a killed
writer never leaves a broken checkpoint behind; loading never runs pickled code. The tests marked
`layouts` also run with the ranks on a GPU (tests/devices.py), where the TP checkpoint also resumes
on the CPU."""

import importlib.util
import json
import os
import pickle
import re
import warnings

import pytest
import torch
from devices import TEST_DEVICE
from helpers import REPO, TINY_DATA, losses_of, run_cli, train_args, train_ok
from safetensors.torch import load_file

from visiondist.checkpoint.files import latest_checkpoint, read_trainer_state
from visiondist.utils.dcp import list_checkpoints

_args, _train, _losses = train_args, train_ok, losses_of


def test_resume_mid_epoch_is_bitwise_exact(tmp_path, tiny_shapes):
    """dp=2 with drop-path (so the RNG states matter): 8 steps straight vs 4, stop, resume=auto, 4
    more. The tiny set has 6 steps per epoch: the stop is mid-epoch and the resumed run crosses an
    epoch boundary."""
    common = [
        "model.num_heads=2",
        "parallel.dp=2",
        "model.drop_path_rate=0.2",
        "trainer.max_steps=8",
        "trainer.checkpoint_every=2",
        "trainer.keep_last=2",
    ]
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(*_args(tiny_shapes, straight, *common))
    out = _train(*_args(tiny_shapes, split, *common, "trainer.stop_at_step=4"))
    assert "stopped after step 4 of 8" in out
    assert [step for step, _ in list_checkpoints(split)] == [2, 4]
    assert not (split / "model.safetensors").exists()
    assert read_trainer_state(latest_checkpoint(split))["epoch"] == 0

    out = _train(*_args(tiny_shapes, split, *common))  # resume=auto is the default
    assert "resumed from" in out and "step_4: step 4 (epoch 1/2, 4 of its 6 steps done)" in out
    a, b = _losses(straight), _losses(split)
    assert sorted(b) == list(range(1, 9))  # rows of the first process kept, none duplicated
    assert [a[s] for s in range(5, 9)] == [b[s] for s in range(5, 9)]  # exact float equality
    assert len({a[s] for s in range(1, 9)}) == 8
    wa, wb = load_file(straight / "model.safetensors"), load_file(split / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [step for step, _ in list_checkpoints(straight)] == [6, 8]  # keep_last=2
    assert (split / "config.yaml").is_file() and len(
        (split / "attempts.jsonl").read_text().splitlines()
    ) == 1


def test_a_log_line_over_fewer_steps_than_log_every_names_them(tmp_path, tiny_shapes):
    """trainer.log_every=4, stopped after step 2 and continued: the line at step 4 averages steps
    3-4 only (the window since the resume) and the run's last, step 5, itself; each says so, where
    the uninterrupted run's step 4 averages 1-4."""
    run = tmp_path / "run"
    common = ["model.num_heads=2", "trainer.max_steps=5", "trainer.log_every=4"]
    out = _train(*_args(tiny_shapes, run, *common, "trainer.stop_at_step=2"))
    assert re.search(r"step 2/5 \| epoch 1/1 \| loss [0-9.]+ \(steps 1-2\) \|", out), out[-2000:]
    out = _train(*_args(tiny_shapes, run, *common))
    assert re.search(r"step 4/5 \| .* \| loss [0-9.]+ \(steps 3-4\) \|", out), out[-2000:]
    assert re.search(r"step 5/5 \| .* \| loss [0-9.]+ \(step 5 alone\) \|", out), out[-2000:]
    straight = _train(*_args(tiny_shapes, tmp_path / "straight", *common))
    assert re.search(r"step 4/5 \| .* \| loss [0-9.]+ \| lr", straight), straight[-2000:]


def test_a_continuation_trains_with_the_rate_and_decay_it_is_given(tmp_path, tiny_shapes):
    """optim.lr and optim.weight_decay changed on continuing (on 2 ranks): the checkpoint restores
    the moments and the schedule's step, and the rates from there are those of a run that had the
    new peak from the start; the log says what changed."""
    from visiondist.observe.metrics import read_metrics

    def rates(run):
        return {int(r["step"]): r["lr"] for r in read_metrics(run / "metrics.csv") if r["lr"]}

    common = ["model.num_heads=2", "trainer.max_steps=6", "schedule.warmup_steps=2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    said = _train(*_args(tiny_shapes, straight, *common, "optim.lr=0.01", "optim.weight_decay=0.1"))
    # the settings that shape every step, said at its start: clipping is on by default
    assert "peak lr 0.01, weight decay 0.1" in said
    assert "gradients clipped to a global norm of 1 (trainer.clip_grad; 0: not clipped)" in said
    _train(*_args(tiny_shapes, split, *common, "trainer.stop_at_step=3"))
    assert json.loads((split / "layout.json").read_text())["world_size"] == 1
    # continued on 2 ranks: layout.json is the attempt's, the layout its checkpoints are saved under
    out = _train(
        *_args(
            tiny_shapes, split, *common, "optim.lr=0.01", "optim.weight_decay=0.1", "parallel.dp=2"
        )
    )
    assert json.loads((split / "layout.json").read_text())["world_size"] == 2
    assert "the optimizer continues with this run's settings: peak LR 0.0005 -> 0.01" in out
    assert "weight_decay as configured" in out
    a, b = rates(straight), rates(split)
    assert b[3] == pytest.approx(a[3] / 20)  # before: the old peak
    assert [b[s] for s in (4, 5, 6)] == pytest.approx([a[s] for s in (4, 5, 6)])
    # each row's lr is the one its step trained with: the warmup's start at step 1, the
    # cosine's end at the last
    from omegaconf import OmegaConf

    from visiondist.engine.optim import lr_factor

    schedule = OmegaConf.load(straight / "config.yaml").schedule
    assert [a[s] for s in range(1, 7)] == pytest.approx(
        [0.01 * lr_factor(s - 1, 6, schedule) for s in range(1, 7)]
    )
    assert a[1] == pytest.approx(0.01 * schedule.warmup_start_factor)


def test_a_period_in_minutes_checkpoints_every_rank_after_the_same_step(tmp_path, tiny_shapes):
    """trainer.checkpoint_every_min (30 by default) is rank 0's clock, carried in the step's
    verdict: both ranks save after the same step (a DCP save is collective: a rank left out would
    hang the other). A period shorter than any step (6 ms) makes each verdict ask for one; it is
    read a step late and a save restarts the clock, so the saves come at least two steps apart.
    The default period writes none in a run this short."""
    common = ["model.num_heads=2", "parallel.dp=2", "trainer.max_steps=8", "trainer.keep_last=0"]
    run = tmp_path / "timed"
    out = _train(*_args(tiny_shapes, run, *common, "trainer.checkpoint_every_min=0.0001"))
    steps = [step for step, _ in list_checkpoints(run)]
    assert steps[-1] == 8 and len(steps) >= 3, (steps, out[-3000:])
    assert all(b - a >= 2 for a, b in zip(steps[:-2], steps[1:-1])), steps
    assert "from its newest checkpoint (one every 0.0001 minutes)" in out
    plain = tmp_path / "plain"
    out = _train(*_args(tiny_shapes, plain, *common))
    assert [step for step, _ in list_checkpoints(plain)] == [8]
    assert "from its newest checkpoint (one every 30 minutes)" in out


RESHARD = ["model.num_heads=4", "trainer.max_steps=3"]  # 4 heads: tp2 and tp4 both divide them


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, tiny_shapes):
    run = tmp_path_factory.mktemp("reshard") / "dp1"
    _train(*_args(tiny_shapes, run, *RESHARD))
    return _losses(run)


# on a GPU, the TP checkpoint is also resumed by one process on the CPU
ON_CPU = ("parallel.dp=1", "trainer.accelerator=cpu", "trainer.share_gpu=false")


@pytest.mark.parametrize(
    "saved_under",
    [
        pytest.param("parallel=tp2", marks=[pytest.mark.smoke, pytest.mark.layouts]),
        "parallel=dp2_tp2",
    ],
)
def test_checkpoint_reshards_to_other_layouts(tmp_path, tiny_shapes, reference_losses, saved_under):
    """Save at step 2 under TP, resume under dp=1 and tp=4 (and, where the ranks ran on a GPU, on
    the CPU): step 3's loss is the uninterrupted run's."""
    saved = tmp_path / "saved"
    _train(*_args(tiny_shapes, saved, *RESHARD, saved_under, "trainer.stop_at_step=2"))
    state = read_trainer_state(latest_checkpoint(saved))
    assert state["step"] == 2 and state["layout"]["tp"] == 2
    for layout in [
        ("parallel.dp=1",),
        ("parallel=tp4",),
        *([ON_CPU] if TEST_DEVICE != "cpu" else []),
    ]:
        run = tmp_path / "_".join(layout).replace("=", "_")
        out = _train(
            *_args(
                tiny_shapes, run, *RESHARD, *layout, f"trainer.resume={latest_checkpoint(saved)}"
            )
        )
        # another layout: RNG streams cannot carry over
        assert "(saved under dp=" in out
        assert "the random states, which are per rank, restart from the seed" in out
        losses = _losses(run)
        assert sorted(losses) == [3]
        assert losses[3] == pytest.approx(reference_losses[3], rel=1e-5)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_checkpoint_metadata_cannot_run_code(tmp_path, tiny_shapes, monkeypatch):
    run = tmp_path / "run"
    _train(*_args(tiny_shapes, run, "model.num_heads=2", "trainer.max_steps=1"))
    checkpoint = latest_checkpoint(run)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    from visiondist.checkpoint.export.trained import load_trained

    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError, match="refused to load posix.system"):
        load_trained(run)
    assert not (tmp_path / "pwned").exists()


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, tiny_shapes):
    run = tmp_path_factory.mktemp("export") / "tp2"
    _train(*_args(tiny_shapes, run, "model.num_heads=4", "trainer.max_steps=2", "parallel=tp2"))
    return run


def _export(run, *args):
    result = run_cli([f"run_dir={run}", *args], timeout=300, script=REPO / "tools" / "export.py")
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


@pytest.mark.smoke
def test_export_from_tp2_loads_in_timm(tp2_run, tmp_path):
    import timm

    from visiondist.checkpoint.export.trained import load_trained

    out = tmp_path / "vit.safetensors"
    _export(tp2_run, f"out={out}")
    info = json.loads(out.with_suffix(".json").read_text())
    assert (
        info["library"] == "timm"
        and info["classes"]
        and len(info["classes"]) == info["num_classes"]
    )
    model = timm.create_model(**info["create"], pretrained=False).eval()
    model.load_state_dict(load_file(out), strict=True)

    trained = load_trained(tp2_run)  # the tp2 checkpoint's shards, read into one process
    # what the tp2 run itself gathered at the end
    gathered = load_file(tp2_run / "model.safetensors")
    assert all(torch.equal(v, gathered[k]) for k, v in trained.model.state_dict().items())
    x = torch.randn(4, 3, info["input_size"], info["input_size"])
    with torch.no_grad():
        assert torch.allclose(model(x), trained.model(x), atol=1e-5, rtol=0)


def test_exported_model_brings_its_preprocessing_to_timm(tp2_run, tiny_shapes, tmp_path):
    """The export used as a new user would: timm.create_model(**create) and the weights, then timm's
    own data config and eval transform on the val split's JPEG files (Pillow). The config is the
    run's, and top-1 is the run's own evaluation of the same weights.

    On the tiny set nothing is resized (32 px images, model.img_size 32, crop_pct 1.0): the two
    pipelines differ only in the JPEG decoder (OpenCV's vs Pillow's libjpeg-turbo) and in the order
    of the normalisation's float operations. Measured here: the decoders give the same pixels and
    the inputs differ by 1.2e-7 (7.5e-6 of an 8-bit level), the logits by 5.5e-7, so the predictions
    and top-1 are required to be equal, not within a point."""
    import timm
    from omegaconf import OmegaConf
    from torchvision.datasets import ImageFolder as PillowFolder

    from visiondist.data.imagefolder import ImageFolder
    from visiondist.data.transforms import ClassificationTransform, Normalize
    from visiondist.observe.metrics import read_metrics

    out = tmp_path / "vit.safetensors"
    _export(tp2_run, f"out={out}")
    info = json.loads(out.with_suffix(".json").read_text())
    model = timm.create_model(**info["create"]).eval()  # pretrained=False is timm's default
    model.load_state_dict(load_file(out), strict=True)
    cfg = timm.data.resolve_model_data_config(model)
    run = OmegaConf.load(tp2_run / "config.yaml")
    size, mean, std = run.model.img_size, list(run.data.mean), list(run.data.std)
    assert (size, mean, std, run.data.crop_pct, run.data.interpolation) == (
        32,
        [0.5] * 3,
        [0.25] * 3,
        1.0,
        "bilinear",
    )
    assert tuple(cfg["input_size"]) == (3, size, size)
    assert list(cfg["mean"]) == mean and list(cfg["std"]) == std
    assert (cfg["crop_pct"], cfg["interpolation"], cfg["crop_mode"]) == (1.0, "bilinear", "center")
    assert timm.data.resolve_model_data_config(model, use_test_size=True) == cfg
    assert (
        info["input_size"],
        info["mean"],
        info["std"],
        info["crop_pct"],
        info["interpolation"],
    ) == (size, mean, std, 1.0, "bilinear")
    assert list(model.pretrained_cfg["label_names"]) == info["classes"]

    val = PillowFolder(str(tiny_shapes / "val"), transform=timm.data.create_transform(**cfg))
    theirs = torch.stack([image for image, _ in val])
    labels = torch.tensor(val.targets)
    ours_set = ImageFolder(
        tiny_shapes / "val", ClassificationTransform(run.data, train=False, size=size, seed=0)
    )
    assert [label for _, label in ours_set.samples] == val.targets
    ours = Normalize(mean, std)(
        torch.stack([ours_set[i][0] for i in range(len(ours_set))]), torch.device("cpu")
    )
    levels = float(((theirs - ours).abs() * torch.tensor(std).view(1, 3, 1, 1) * 255).max())
    assert levels < 1e-3, (
        f"the inputs differ by up to {levels:.3g} of an 8-bit level: the JPEG decoders disagree"
    )
    with torch.no_grad():
        logits, reference = model(theirs), model(ours)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-4)
    # the predictions are equal wherever round-off cannot decide them: the two inputs, and the run's
    # evaluation under tp2, differ by about 1e-6 in the logits; an image whose two best logits are
    # nearer than 1e-4 may go either way
    best = reference.topk(2, 1).values
    clear = best[:, 0] - best[:, 1] > 1e-4
    assert int(clear.sum()) >= len(clear) - 1, (best[:, 0] - best[:, 1]).min()
    assert torch.equal(logits.argmax(1)[clear], reference.argmax(1)[clear])
    top1 = 100 * float((logits.argmax(1) == labels).double().mean())
    final = [r for r in read_metrics(tp2_run / "metrics.csv") if r["val_top1"] is not None][-1]
    assert final["step"] == 2 and len(val) == 30
    # 30 images: one disagreement would be 3.3 points
    assert top1 == pytest.approx(final["val_top1"], abs=100 * int((~clear).sum()) / len(val) + 1e-9)


@pytest.mark.smoke
def test_export_onnx_and_torchscript(tp2_run, tmp_path):
    """Both formats load and match PyTorch; each command prints what it exported and the file it
    wrote, nothing of torch.onnx's progress or torch.jit's deprecation warnings."""
    import onnxruntime as ort

    from visiondist.checkpoint.export.trained import load_trained

    out = tmp_path / "vit.onnx"
    stdout = _export(tp2_run, "format=onnx", f"out={out}")
    lines = stdout.splitlines()
    assert lines[:2] == [lines[0], f"  {out}"] and lines[0].startswith("exported vit_tiny from "), (
        stdout
    )
    assert len(lines) == 3 and lines[2].startswith("  ONNX Runtime vs PyTorch"), stdout
    trained = load_trained(tp2_run)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch in (1, 5):  # the batch dimension is dynamic
        x = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            ref = trained.model(x)
        got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
        assert torch.allclose(got, ref, atol=1e-4, rtol=0)

    script = tmp_path / "vit.pt"
    stdout = _export(tp2_run, "format=torchscript", f"out={script}")
    lines = stdout.splitlines()
    assert lines[1] == f"  {script}" and len(lines) == 3 and "Warning" not in stdout, stdout
    # its own check line, as every format prints
    assert lines[2].startswith(
        "  TorchScript vs PyTorch: logits of 1 and 3 random images compared, max abs difference "
    ), stdout
    assert float(lines[2].rsplit(" ", 1)[1]) < 1e-4, stdout
    with warnings.catch_warnings():  # torch 2.15 calls torch.jit.load deprecated
        warnings.simplefilter("ignore", FutureWarning)
        loaded = torch.jit.load(str(script))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(loaded(x), trained.model(x), atol=1e-5, rtol=0)


def _evaluated(weights, settings: list[str], out) -> dict:
    """tools/eval.py weights=`weights` under `settings` into `out`: its eval.json, the run required
    to succeed."""
    evaluated = run_cli(
        [f"weights={weights}", *settings, f"trainer.run_dir={out}"],
        timeout=300,
        script=REPO / "tools" / "eval.py",
    )
    assert evaluated.returncode == 0, evaluated.stdout[-4000:]
    return json.loads((out / "eval.json").read_text())


def test_eval_and_predict_run_the_exported_files(tp2_run, tiny_shapes, tmp_path):
    """tools/eval.py and tools/predict.py take the run's ONNX graph and torch.export program as
    weights=, run them by their runtime (ONNX Runtime, torch), and give what the run's own weights
    give under the same settings: the same top-1 over the val split, the same top-5 labels for each
    val image with their probabilities to round-off; eval.json names the runtime."""
    import csv

    onnx_file, program = tmp_path / "vit.onnx", tmp_path / "vit.pt2"
    _export(tp2_run, "format=onnx", f"out={onnx_file}")
    _export(tp2_run, "format=pt2", f"out={program}")
    settings = [*TINY_DATA, f"data.root={tiny_shapes}", "model.num_heads=4"]
    settings += ["trainer.accelerator=cpu"]
    results = {
        name: _evaluated(weights, settings, tmp_path / name / "eval")
        for name, weights in (("own", tp2_run / "model.safetensors"), ("onnx", onnx_file))
    }
    for name, weights in (
        ("own", tp2_run / "model.safetensors"),
        ("onnx", onnx_file),
        ("pt2", program),
    ):
        predicted = run_cli(
            [
                f"weights={weights}",
                f"source={tiny_shapes / 'val'}",
                *settings,
                f"out={tmp_path / name / 'predict'}",
            ],
            timeout=300,
            script=REPO / "tools" / "predict.py",
        )
        assert predicted.returncode == 0, predicted.stdout[-4000:]
        with open(tmp_path / name / "predict" / "predictions.csv") as f:
            results[f"{name} rows"] = list(csv.DictReader(f))
    assert results["onnx"]["run by"] == "ONNX Runtime" and "run by" not in results["own"]
    assert results["onnx"]["val_top1"] == results["own"]["val_top1"]
    assert results["onnx"]["val_loss"] == pytest.approx(results["own"]["val_loss"], abs=1e-5)
    own = results["own rows"]
    assert len(own) == 30
    for name in ("onnx", "pt2"):
        rows = results[f"{name} rows"]
        assert [r["file"] for r in rows] == [r["file"] for r in own]
        for mine, theirs in zip(rows, own):
            assert mine["label_1"] == theirs["label_1"], (name, mine, theirs)
            for k in range(1, 6):
                assert abs(float(mine[f"prob_{k}"]) - float(theirs[f"prob_{k}"])) < 1e-5


def test_half_and_int8_exports_print_their_val_accuracy_beside_float32s(tp2_run, tmp_path):
    """From a run trained under tp2: format=onnx half=true and int8=true each write their file,
    its check line against PyTorch's float32 and the val split's top-1 of the float32 and the
    converted file, each evaluated by ONNX Runtime in one process; the files run as weights=."""
    import re

    import onnx

    for key, precision in (("half", "float16"), ("int8", "int8")):
        out = tmp_path / f"vit_{key}.onnx"
        said = _export(tp2_run, "format=onnx", f"{key}=true", f"out={out}").splitlines()
        # a progress line before each file's evaluation (minutes on a large val split)
        scoring = [line for line in said if line.startswith("scoring ")]
        assert scoring == [
            f"scoring {n} on the run's val split ..." for n in ("the float32 graph", out.name)
        ]
        lines = [line for line in said if not line.startswith("scoring ")]
        assert lines[1] == f"  {out}" and len(lines) == 4, lines
        assert lines[2].startswith(f"  ONNX Runtime ({precision} network) vs PyTorch (float32): ")
        top1 = re.fullmatch(
            rf"  val top-1 \(30 images\): (\S+)% float32 -> (\S+)% {precision} \(([-+]\S+) "
            r"points\), each file evaluated by ONNX Runtime",
            lines[3],
        )
        assert top1, lines[3]
        assert abs(float(top1[2]) - float(top1[1])) <= 10, lines[3]  # 3 images of 30 at most
        meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
        assert meta["precision"] == precision and json.loads(meta["classes"])
    refused = run_cli(
        [f"run_dir={tp2_run}", "format=pt2", "half=true"],
        timeout=120,
        script=REPO / "tools" / "export.py",
    )
    assert refused.returncode == 2
    assert (
        "half=true applies to format=onnx, not format=pt2: add format=onnx, or drop half=true"
        in refused.stdout
    )


def test_an_openvino_ir_is_checked_and_evaluates_as_the_runs_weights(
    tp2_run, tiny_shapes, tmp_path
):
    """format=openvino: the IR (.xml, .bin) and its sidecar, checked on OpenVINO's CPU plugin in
    float32 against PyTorch's logits to round-off; tools/eval.py weights=<the .xml> runs it by
    OpenVINO to the run's own weights' top-1 under the same settings. (OpenVINO runs in the tools'
    processes here, never in a test's: its thread pools stay out of the test workers.)"""
    pytest.importorskip("openvino")
    out = tmp_path / "vit_openvino.xml"
    lines = _export(tp2_run, "format=openvino", f"out={out}").splitlines()
    assert lines[1:4] == [
        f"  {out}",
        f"  {out.with_suffix('.bin')}",
        f"  {out.with_suffix('.json')}",
    ]
    assert lines[4].startswith("  OpenVINO vs PyTorch: logits of 2 random images compared"), lines
    assert float(lines[4].rsplit(" ", 1)[1]) < 1e-4, lines
    settings = [
        *TINY_DATA,
        f"data.root={tiny_shapes}",
        "model.num_heads=4",
        "trainer.accelerator=cpu",
    ]
    scores = {
        name: _evaluated(weights, settings, tmp_path / name)
        for name, weights in (("own", tp2_run / "model.safetensors"), ("openvino", out))
    }
    assert scores["openvino"]["run by"] == "OpenVINO"
    assert scores["openvino"]["val_top1"] == scores["own"]["val_top1"]


def test_export_benchmark_times_and_scores_every_form_in_one_table(tp2_run, tmp_path):
    """tools/export.py benchmark=true: every file form written, evaluated on the val split and
    timed beside PyTorch, in one table (benchmark.md) and its rows (benchmark.json): the float32
    files score the run's own top-1, each row has both batch timings."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tp2_run, run)
    out = _export(run, "benchmark=true")
    work = run / "export" / "benchmark"
    rows = {r["form"]: r for r in json.loads((work / "benchmark.json").read_text())}
    forms = ["PyTorch eager", "PyTorch compiled", "ONNX", "ONNX float16", "ONNX int8", "pt2"]
    if importlib.util.find_spec("openvino") is not None:
        forms.insert(5, "OpenVINO")
    assert list(rows) == forms, out[-3000:]
    assert not [r for r in rows.values() if "skipped" in r], rows
    for form, row in rows.items():
        assert row["ms_batch1"] > 0 and row["ms_batch8"] > 0, row
        if form != "PyTorch compiled":  # timed only: the same weights as eager
            assert row["metric"] == "top-1" and row["val_images"] == 30, row
    for form in ("ONNX", "OpenVINO", "pt2"):
        if form in rows:
            assert rows[form]["value"] == rows["PyTorch eager"]["value"], rows[form]
    table = (work / "benchmark.md").read_text()
    assert all(f"| {form} |" in table for form in forms) and "val top-1 (30 images)" in table
    assert f"written: {work / 'benchmark.md'}, {work / 'benchmark.json'}" in out


def test_export_hf_of_a_vit_loads_in_transformers_and_timm_and_predicts_here(
    tp2_run, tmp_path, tiny_shapes
):
    """format=hf of a tp2-trained ViT: a timm repository (config.json, model.safetensors) that
    transformers' AutoModelForImageClassification and timm's local-dir: load with the run's class
    names and preprocessing, giving the run's logits; the tool prints its check; predict takes the
    directory as weights= and gives what the run's own model.safetensors gives."""
    import re

    import timm
    from transformers import AutoModelForImageClassification

    from visiondist.checkpoint.export.trained import load_trained

    trained = load_trained(tp2_run)
    repo = tmp_path / "vit_hf"
    stdout = _export(tp2_run, "format=hf", f"out={repo}")
    assert sorted(p.name for p in repo.iterdir()) == [
        "config.json",
        "model.json",
        "model.safetensors",
    ]
    # every file shared alike (safetensors itself writes 0o600)
    assert len({p.stat().st_mode for p in repo.iterdir()}) == 1
    checked = re.search(
        r"  transformers \(TimmWrapperForImageClassification\) vs PyTorch: logits of 1 and 3 "
        r"random images compared, max abs difference (\S+)",
        stdout,
    )
    assert checked and float(checked[1]) < 1e-5 and "Warning" not in stdout, stdout
    x = torch.randn(3, 3, 32, 32)
    wrapped = AutoModelForImageClassification.from_pretrained(str(repo)).eval()
    loaded = timm.create_model(f"local-dir:{repo}", pretrained=True).eval()
    with torch.no_grad():
        want = trained.model(x)
        torch.testing.assert_close(wrapped(pixel_values=x).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(loaded(x), want, rtol=0, atol=1e-5)
    assert [wrapped.config.id2label[i] for i in range(6)] == trained.classes
    data = timm.data.resolve_model_data_config(loaded)
    assert data["input_size"] == (3, 32, 32) and list(data["mean"]) == [0.5, 0.5, 0.5]
    outs = []
    for weights in (repo, tp2_run / "model.safetensors"):
        out = tmp_path / f"predict_{len(outs)}"
        args = [f"weights={weights}", f"source={tiny_shapes / 'val'}", f"out={out}", "topk=2",
                "save_images=0", "trainer.progress=false"]  # fmt: skip
        result = run_cli(args, timeout=240, script=REPO / "tools" / "predict.py")
        assert result.returncode == 0, result.stdout[-3000:]
        outs.append((out / "predictions.csv").read_text())
    assert outs[0] == outs[1]


@pytest.mark.smoke
def test_export_pt2_takes_any_batch_and_carries_its_preprocessing(tp2_run, tmp_path):
    """From a run trained under tp2: the program matches PyTorch at any batch, the tool prints its
    own check and no warning, the archive carries the classes and preprocessing, and
    docs/checkpoints.md's code runs on it."""
    import re
    import textwrap

    from visiondist.checkpoint.export.trained import load_trained

    trained = load_trained(tp2_run)
    program_file = tmp_path / "vit.pt2"
    stdout = _export(tp2_run, "format=pt2", f"out={program_file}")
    lines = stdout.splitlines()
    assert lines[1] == f"  {program_file}" and len(lines) == 3 and "Warning" not in stdout, stdout
    checked = re.fullmatch(
        r"  torch\.export program vs PyTorch: logits of 1 and 3 random images compared, max abs "
        r"difference (\S+)",
        lines[2],
    )
    assert checked and float(checked[1]) < 1e-5, stdout
    extra = {"visiondist.json": ""}
    program = torch.export.load(str(program_file), extra_files=extra)
    info = json.loads(extra["visiondist.json"])
    assert info["classes"] == trained.classes and len(info["classes"]) == 6
    assert (info["input_size"], info["task"]) == (32, "classification") and len(info["mean"]) == 3
    for batch in (1, 3, 7):  # exported with a batch of 2; the batch dimension is dynamic
        x = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(x), trained.model(x), rtol=0, atol=1e-5)
    # docs/checkpoints.md's code, as printed there, on this file
    docs = (REPO / "docs" / "checkpoints.md").read_text()
    [block] = [
        textwrap.dedent(b)
        for b in re.findall(r"```python\n(.*?) *```", docs, re.S)
        if "torch.export.load" in b
    ]
    names = {"images": torch.randn(4, 3, 32, 32)}
    exec(block.replace("outputs/small_ddp/export/model.pt2", str(program_file)), names)
    assert names["info"]["classes"] == trained.classes
    with torch.no_grad():
        torch.testing.assert_close(
            names["logits"], trained.model(names["images"]), rtol=0, atol=1e-5
        )


def test_export_errors_name_the_fix(tmp_path):
    result = run_cli(["format=onnx"], timeout=60, script=REPO / "tools" / "export.py")
    assert result.returncode == 2 and "run_dir= is missing" in result.stdout
    result = run_cli(
        [f"run_dir={tmp_path}", "format=pdf"], timeout=60, script=REPO / "tools" / "export.py"
    )
    assert (
        result.returncode == 2
        and "choose one of safetensors, onnx, pt2, torchscript" in result.stdout
    )
    result = run_cli([f"run_dir={tmp_path}"], timeout=60, script=REPO / "tools" / "export.py")
    assert result.returncode == 2 and "holds no config.yaml" in result.stdout
    result = run_cli(
        [f"run_dir={tmp_path / 'nope'}"], timeout=60, script=REPO / "tools" / "export.py"
    )
    assert result.returncode == 2 and f"{tmp_path / 'nope'}: no such directory" in result.stdout
    checkpoint = tmp_path / "checkpoints" / "step_7"  # a checkpoint given as the run
    checkpoint.mkdir(parents=True)
    (tmp_path / "config.yaml").write_text("{}")
    result = run_cli([f"run_dir={checkpoint}"], timeout=60, script=REPO / "tools" / "export.py")
    assert result.returncode == 2 and f"give run_dir={tmp_path} step=7" in result.stdout, (
        result.stdout
    )
    # a file named as another format's: refused before anything is read or written
    result = run_cli(
        [f"run_dir={tmp_path}", "format=pt2", f"out={tmp_path / 'vit.onnx'}"],
        timeout=60,
        script=REPO / "tools" / "export.py",
    )
    assert (
        result.returncode == 2
        and "a .onnx file is what format=onnx writes; format=pt2 writes .pt2: name it "
        "vit.pt2, or give format=onnx"
        in result.stdout
    ), result.stdout
    assert not (tmp_path / "vit.onnx").exists()
