"""Training-recipe parts: model EMA (any layout, checkpointed, evaluated), layer-wise LR decay and
label smoothing under a pipeline, mixup / cutmix through timm (also under a pipeline), and
fine-tuning from an exported run."""

import json
import re

import pytest
from helpers import (
    REPO,
    TINY_DATA,
    assert_same_top1,
    losses_of,
    run_cli,
    train_args,
    train_ok,
)
from omegaconf import OmegaConf
from safetensors.torch import load_file

from visiondist.engine.optim import lr_factor
from visiondist.observe.metrics import read_metrics


def test_mixup_and_cutmix_under_a_pipeline_give_the_unpipelined_losses(tmp_path, tiny_shapes):
    """pp=2 (the first stage mixes the images, the last the labels, 4 micro-batches) against one
    process on the same global batch, with mixup and cutmix both on, and TrivialAugment and random
    erasing on the first stage's device: the same loss at every step."""
    mix = [
        "model.num_heads=2",
        "model.depth=2",
        "trainer.max_steps=6",
        "data.mixup=0.8",
        "data.cutmix=1.0",
        "trainer.label_smoothing=0.1",
        "trainer.eval_every=0",
        "data.auto_augment=trivial",
        "data.random_erasing=0.5",
    ]
    one, pp = tmp_path / "one", tmp_path / "pp"
    train_ok(*train_args(tiny_shapes, one, *mix, "parallel.dp=1"))
    train_ok(*train_args(tiny_shapes, pp, *mix, "parallel=pp2"))
    a, b = losses_of(one), losses_of(pp)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [b[s] for s in a] == pytest.approx([a[s] for s in a], rel=1e-5)
    plain = tmp_path / "plain"  # and the mixing is on: without it the losses differ
    train_ok(
        *train_args(
            tiny_shapes,
            plain,
            *mix[:3],
            "trainer.label_smoothing=0.1",
            "trainer.eval_every=0",
            "parallel.dp=1",
        )
    )
    assert losses_of(plain)[2] != pytest.approx(a[2], rel=1e-3)


DEIT = [
    "model.num_heads=2",
    "model.depth=2",
    "trainer.max_steps=6",
    "trainer.eval_every=6",
    "data.auto_augment=rand",
    "data.random_erasing=0.25",
    "trainer.label_smoothing=0.1",
]


def test_deit_augmentation_on_the_device_under_dp2_gives_the_loader_paths_run(
    tmp_path, tiny_shapes
):
    """The DeiT recipe's per-sample augmentation (RandAugment 2/9, random erasing 0.25; smoothing):
    RandAugment in the loader on one process (no workers) against RandAugment on the device,
    batched, under dp=2 with 2 loader workers per rank (the parameter rows go through the workers'
    shared memory as the shipped settings send them). Each sample's parameters come from its own
    seed, so both see the same pixels: the same loss at every step and the same evaluation. Without
    the augmentation the losses differ. (Mixup / cutmix pair the samples of one DP rank, as timm's
    do, so they differ between dp=1 and dp=2 by design: the pipeline test above runs them with the
    device augmentation.)"""
    loader, device, plain = tmp_path / "loader", tmp_path / "device", tmp_path / "plain"
    train_ok(*train_args(tiny_shapes, loader, *DEIT, "parallel.dp=1", "data.augment_on=loader"))
    train_ok(
        *train_args(
            tiny_shapes,
            device,
            *DEIT,
            "parallel.dp=2",
            "data.augment_on=device",
            "data.num_workers=2",
        )
    )
    a, b = losses_of(loader), losses_of(device)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [b[s] for s in a] == pytest.approx([a[s] for s in a], rel=1e-5)
    rows = {
        run: [r for r in read_metrics(run / "metrics.csv") if r["val_loss"] is not None]
        for run in (loader, device)
    }
    assert_same_top1(rows[loader][-1]["val_top1"], rows[device][-1]["val_top1"])
    assert rows[loader][-1]["val_loss"] == pytest.approx(rows[device][-1]["val_loss"], rel=1e-5)
    train_ok(
        *train_args(tiny_shapes, plain, *DEIT[:4], "trainer.label_smoothing=0.1", "parallel.dp=1")
    )
    assert losses_of(plain)[2] != pytest.approx(a[2], rel=1e-3)


def test_jpeg_decoding_on_the_device_trains_as_the_loader_path(tmp_path, tiny_shapes):
    """data.decode_on=device under dp=2 with 2 workers per rank (the workers hand over JPEG bytes
    and crops; each rank decodes, crops and flips; random erasing on the device) against the loader
    path on one process: the same samples, crops and erasing; pixels within one grey level (resize
    rounding), so the losses agree to 0.2% and the evaluation (CPU-decoded on both) to 1%.
    RandAugment is left out here: its thresholds (solarize, posterize, equalize) turn a one-level
    difference into larger ones (1.8% at one step of six); its device ops are compared with the
    loader's on the same pixels in tests/unit/test_augment.py."""
    loader, device = tmp_path / "loader", tmp_path / "device"
    recipe = [o for o in DEIT if not o.startswith("data.auto_augment")]
    train_ok(*train_args(tiny_shapes, loader, *recipe, "parallel.dp=1"))
    out = train_ok(
        *train_args(
            tiny_shapes,
            device,
            *recipe,
            "parallel.dp=2",
            "data.decode_on=device",
            "data.num_workers=2",
        )
    )
    assert "decoded in the loader workers" not in out  # every built-in image is a baseline JPEG
    # torchcodec's or torchvision's decoder
    assert "training and val JPEGs are decoded on cpu by torch" in out
    summary = json.loads((device / "summary.json").read_text())["decode_on=device (rank 0)"]
    assert summary.startswith("48 of 48 images by torch") and summary.endswith(
        ", 0 in the loader workers"
    )
    a, b = losses_of(loader), losses_of(device)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [b[s] for s in a] == pytest.approx([a[s] for s in a], rel=2e-3)
    rows = {
        run: [r for r in read_metrics(run / "metrics.csv") if r["val_loss"] is not None]
        for run in (loader, device)
    }
    assert rows[device][-1]["val_loss"] == pytest.approx(rows[loader][-1]["val_loss"], rel=1e-2)


RECIPE = [
    "model.num_heads=2",
    "model.depth=4",
    "trainer.max_steps=4",
    "trainer.eval_every=2",
    "trainer.ema_decay=0.5",
    "optim.layer_decay=0.7",
    "trainer.label_smoothing=0.1",
]


def test_ema_layer_decay_and_smoothing_agree_across_layouts_and_resume(tmp_path, tiny_shapes):
    """One process accumulating 4 micro-batches vs pp=2 stopped after step 2 and resumed: same
    losses, same model and EMA evaluations."""
    one, pp = tmp_path / "one", tmp_path / "pp"
    train_ok(*train_args(tiny_shapes, one, *RECIPE, "parallel.dp=1", "trainer.grad_accum=4"))
    train_ok(*train_args(tiny_shapes, pp, *RECIPE, "parallel=pp2", "trainer.stop_at_step=2"))
    # resume=auto: the EMA comes back too
    train_ok(*train_args(tiny_shapes, pp, *RECIPE, "parallel=pp2"))
    a, b = losses_of(one), losses_of(pp)
    assert [b[s] for s in range(1, 5)] == pytest.approx([a[s] for s in range(1, 5)], rel=1e-5)
    rows = {}
    for run in (one, pp):
        rows[run] = {
            int(r["step"]): r
            for r in read_metrics(run / "metrics.csv")
            if r["val_loss"] is not None
        }
    assert sorted(rows[one]) == sorted(rows[pp]) == [2, 4]
    for step in (2, 4):
        x, y = rows[one][step], rows[pp][step]
        assert y["val_ema_loss"] == pytest.approx(x["val_ema_loss"], rel=1e-5)
        assert_same_top1(y["val_ema_top1"], x["val_ema_top1"])
        assert_same_top1(y["val_top1"], x["val_top1"])
        # the average is not the model
        assert x["val_ema_loss"] != pytest.approx(x["val_loss"], rel=1e-3)
    assert "val top-1, EMA (%)" in json.loads((pp / "summary.json").read_text())
    per_class = json.loads((pp / "per_class.json").read_text())
    assert len(per_class) == 6 and sum(c["images"] for c in per_class.values()) == 30
    # the EMA the run scored is what the tools read with ema=true: tools/eval.py on the run, and
    # the pipelined run's export, evaluated as a file
    evaluate = REPO / "tools" / "eval.py"
    train_ok(f"run_dir={one}", "ema=true", f"trainer.run_dir={tmp_path / 'e1'}", script=evaluate)
    scored = json.loads((tmp_path / "e1" / "eval.json").read_text())
    assert scored["ema"] and scored["val_loss"] == pytest.approx(
        rows[one][4]["val_ema_loss"], rel=1e-5
    )
    said = train_ok(f"run_dir={pp}", "ema=true", script=REPO / "tools" / "export.py")
    assert "(its EMA of the weights)" in said
    # the model's shape and input size from the export's model_ema.json, not from the command
    data = [a for a in TINY_DATA if not a.startswith(("model.", "data.img_size"))]
    data.append(f"data.root={tiny_shapes}")
    exported = pp / "export" / "model_ema.safetensors"
    said = train_ok(
        f"weights={exported}", *data, f"trainer.run_dir={tmp_path / 'e2'}", script=evaluate
    )
    assert (
        "model=vit_tiny model.depth=4 model.num_heads=2 data.img_size=32 as model_ema.json" in said
    )
    scored = json.loads((tmp_path / "e2" / "eval.json").read_text())
    assert scored["val_loss"] == pytest.approx(rows[one][4]["val_ema_loss"], rel=1e-5)


def test_fine_tuning_from_an_exported_run_starts_at_its_accuracy(tmp_path, tiny_shapes):
    """Train, export to timm's keys, start a new run from the export: its evaluation before the
    first step equals the source run's final one."""
    source = tmp_path / "source"
    common = ["model.num_heads=2", "model.depth=2"]
    train_ok(*train_args(tiny_shapes, source, *common, "trainer.max_steps=6"))
    train_ok(f"run_dir={source}", script=REPO / "tools" / "export.py")
    exported = source / "export" / "model.safetensors"
    # a run without an EMA: ema=true is refused, naming why
    refused = run_cli([f"run_dir={source}", "ema=true"], script=REPO / "tools" / "export.py")
    assert refused.returncode == 2 and "trained with trainer.ema_decay=0" in refused.stdout
    assert any(".attn.qkv." in k for k in load_file(exported))  # timm's keys
    tuned = tmp_path / "tuned"
    train_ok(
        *train_args(
            tiny_shapes,
            tuned,
            *common,
            f"model.init_from={exported}",
            "trainer.eval_at_start=true",
            "trainer.max_steps=1",
            "optim.layer_decay=0.75",
        )
    )
    final = [r for r in read_metrics(source / "metrics.csv") if r["val_loss"] is not None][-1]
    start = [r for r in read_metrics(tuned / "metrics.csv") if r["val_loss"] is not None][0]
    assert start["step"] == 0
    assert start["val_top1"] == final["val_top1"] and start.get("val_top5") == final.get("val_top5")
    assert start["val_loss"] == pytest.approx(final["val_loss"], rel=1e-6)
    # the logged lr is the head's (the peak group's), not the patch embedding's 0.75 ** 3 of it
    cfg = OmegaConf.load(tuned / "config.yaml")
    logged = [r["lr"] for r in read_metrics(tuned / "metrics.csv") if r["lr"] is not None]
    assert logged == pytest.approx([cfg.optim.lr * lr_factor(0, 1, cfg.schedule)], rel=1e-6)


def test_files_the_device_cannot_decode_are_named_once_and_the_count_says_why_it_is_larger(
    tmp_path, tiny_shapes
):
    """The built-in tree plus a PNG, a CMYK JPEG and an EXIF-turned JPEG, and a PNG among the val
    images, data.decode_on=device with the shipped 2 workers, 3 epochs: one log line, the first
    time, with the count so far and the first names with why; worker_decoded.txt lists all four, and
    the summary counts the training reads (each file every epoch) beside the files."""
    import shutil

    from PIL import Image

    data = tmp_path / "data"
    shutil.copytree(tiny_shapes, data)
    folder = sorted(p for p in (data / "train").iterdir() if p.is_dir())[0]
    source = sorted(folder.glob("*.jpg"))
    Image.open(source[0]).save(folder / "odd_png.png")
    Image.open(source[1]).convert("CMYK").save(folder / "odd_cmyk.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.open(source[2]).save(folder / "odd_exif.jpg", exif=exif)
    val_folder = data / "val" / folder.name
    # evaluation decodes alike
    Image.open(sorted(val_folder.glob("*.jpg"))[0]).save(val_folder / "odd_val.png")
    run = tmp_path / "run"
    out = train_ok(
        *train_args(
            data,
            run,
            "data.decode_on=device",
            "data.num_workers=2",
            "model.num_heads=2",
            "trainer.max_epochs=3",
            "trainer.max_steps=0",
            "trainer.eval_every=1000",
        )
    )
    odd = {
        "odd_png.png": "not a JPEG",
        "odd_cmyk.jpg": "JPEG of 4 components (CMYK)",
        "odd_exif.jpg": "EXIF orientation 6",
    }
    (line,) = [line for line in out.splitlines() if "decoded in the loader workers" in line]
    count = re.search(
        r"data.decode_on=device: (\d+) files? so far (is|are) decoded in the loader workers, not "
        r"on the device: (.*) \(worker_decoded.txt lists every one; the run's summary counts "
        r"them\)$",
        line,
    )
    assert count and 1 <= int(count[1]) <= 3, line
    files = {
        *{f"{folder / name} ({why})" for name, why in odd.items()},
        f"{val_folder / 'odd_val.png'} (not a JPEG)",
    }
    assert sum(f in count[3] for f in files) == int(count[1]), line
    listed = (run / "worker_decoded.txt").read_text().splitlines()
    assert sorted(listed) == sorted(
        [
            *(f"{folder / name}\t{why}" for name, why in odd.items()),
            f"{val_folder / 'odd_val.png'}\tnot a JPEG",
        ]
    )
    summary = json.loads((run / "summary.json").read_text())["decode_on=device (rank 0)"]
    reads = re.search(
        r", (\d+) in the loader workers \(4 files of any rank, training's and evaluation's, in "
        r"worker_decoded.txt; a training file counts each time it is read\)$",
        summary,
    )
    # 3 epochs; an epoch's batches leave 3 of 99 images out
    assert reads and 3 < int(reads[1]) <= 9, summary
