"""What is decided in the launching process before any rank starts, through the tools' `main(argv)`
in this process: evaluation reads (and checks) only the val split; a class folder without images and
a training split smaller than one global batch stop with exit 2 and one line, with no run directory;
a layout of several ranks with no GPU found under `trainer.accelerator=auto` stops with the time
model's estimate; `data.num_workers=-1` follows the cores per rank."""

import json
import re

import numpy as np
import pytest
from helpers import REPO, call_tool, load_tool
from omegaconf import OmegaConf
from PIL import Image

CONFIGS = REPO / "configs"
EXTENSIONS = ".jpg, .jpeg, .png, .bmp, .webp, .tif, .tiff"


_tool, _call = load_tool, call_tool


def _imagenet(root, train, val):
    """An ImageFolder tree: `train` / `val` map class -> image count (0: an empty class folder)."""
    rng = np.random.default_rng(0)
    for split, classes in (("train", train), ("val", val)):
        for name, count in classes.items():
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.jpg")
    return root


def _refused(capsys, tmp_path, name, *argv):
    """The one `error:` line of a tool that stopped before launch, having written nothing under its
    output dir."""
    out = tmp_path / "out"
    code, stdout, err = _call(capsys, name, *argv, f"trainer.output_dir={out}")
    assert code == 2, (stdout[-2000:], err)
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not out.exists()  # no run directory
    return err[0]


TRAIN = [
    "model=vit_tiny",
    "data=imagenet",
    "trainer.accelerator=cpu",
    "data.num_workers=0",
    "trainer.loggers=[csv]",
    "trainer.progress=false",
]


# -- 3: evaluation reads the val split only --------------------------------------------------------


def test_eval_of_weights_reads_only_the_val_split(tmp_path, capsys):
    """tools/eval.py weights=<file> on data whose train split is smaller than the training batch
    (1024), then on data without a train split: both evaluate the 4 val images (one partial eval
    batch)."""
    from visiondist.cli import load_config
    from visiondist.models import build_model
    from visiondist.models.weights import save_weights

    root = _imagenet(tmp_path / "imagenet", {"cat": 2, "dog": 2}, {"cat": 2, "dog": 2})
    cfg = load_config(
        CONFIGS, ["model=vit_tiny", "data=imagenet", f"data.root={root}"], inputs=None
    )
    save_weights(build_model(cfg.model).state_dict(), tmp_path / "w.safetensors")
    for run in ("with_train", "val_only"):
        if run == "val_only":
            for f in (root / "train").rglob("*.jpg"):
                f.unlink()
            for d in (root / "train").iterdir():
                d.rmdir()
            (root / "train").rmdir()
        out = tmp_path / run
        code, stdout, err = _call(
            capsys,
            "eval",
            f"weights={tmp_path / 'w.safetensors'}",
            *TRAIN,
            f"data.root={root}",
            f"trainer.output_dir={out}",
        )
        assert code == 0, (stdout[-3000:], err)
        assert "val top-1:" in stdout
        (result,) = (out / "eval").glob("*/eval.json")
        metrics = json.loads(result.read_text())
        assert sum(metrics["val_class_count"]) == 4 and len(metrics["val_class_count"]) == 2


def test_eval_checks_only_the_val_split(tmp_path):
    """An empty training class folder does not concern evaluation; an empty val one does."""
    from visiondist.cli import checked, load_config
    from visiondist.config import ConfigError

    root = _imagenet(tmp_path / "imagenet", {"cat": 0, "dog": 2}, {"cat": 2, "dog": 2})
    cfg = load_config(
        CONFIGS, ["model=vit_tiny", "data=imagenet", f"data.root={root}"], inputs=None
    )
    checked(cfg, "eval")
    with pytest.raises(ConfigError, match=r"class folder train/cat holds no images"):
        checked(cfg, "train")
    (root / "val" / "dog" / "0.jpg").unlink()
    (root / "val" / "dog" / "1.jpg").unlink()
    with pytest.raises(ConfigError, match=r"class folder val/dog holds no images"):
        checked(cfg, "eval")


# -- 5: the data's images, before launch -----------------------------------------------------------


def test_an_empty_class_folder_stops_training_before_launch(tmp_path, capsys):
    root = _imagenet(
        tmp_path / "imagenet", {"cat": 3, "dog": 0, "eel": 3}, {"cat": 1, "dog": 1, "eel": 1}
    )
    line = _refused(capsys, tmp_path, "train", *TRAIN, f"data.root={root}", "data.batch_size=2")
    assert line == (
        f"error: data.root={root}: class folder train/dog holds no images ({EXTENSIONS}): add "
        "images or remove the folder"
    )


def test_a_training_split_smaller_than_one_global_batch_stops_before_launch(tmp_path, capsys):
    root = _imagenet(tmp_path / "imagenet", {"cat": 6, "dog": 6}, {"cat": 1, "dog": 1})
    # imagenet's data.batch_size=1024
    line = _refused(capsys, tmp_path, "train", *TRAIN, f"data.root={root}")
    assert line == (
        f"error: data.root={root}: the training split train/ has 12 images, fewer than one global "
        "batch data.batch_size=1024: lower data.batch_size (e.g. data.batch_size=8) or add images"
    )
    from visiondist.cli import load_config

    assert (
        load_config(CONFIGS, [*TRAIN, f"data.root={root}", "data.batch_size=12"]).data.batch_size
        == 12
    )


def test_train_and_val_class_folders_must_match(tmp_path):
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    root = _imagenet(tmp_path / "imagenet", {"cat": 2, "dog": 2}, {"cat": 1, "eel": 1})
    with pytest.raises(
        ConfigError,
        match=r"the class folders of val/ and train/ differ \(only in train/: dog; only "
        r"in val/: eel\)",
    ):
        load_config(CONFIGS, [*TRAIN, f"data.root={root}", "data.batch_size=4"])


def test_a_built_in_set_smaller_than_one_global_batch(tmp_path):
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"^data=shapes: data.synthetic.train_per_class gives 12 training images, "
        r"fewer than one global batch data.batch_size=64: lower data.batch_size "
        r"\(e.g. data.batch_size=8\) or raise data.synthetic.train_per_class$",
    ):
        load_config(
            CONFIGS, ["data.synthetic.train_per_class=2", f"data.root={tmp_path / 'shapes'}"]
        )


def _coco(root, sizes, boxed):
    """A COCO training and val split: `sizes` (width, height) per image, the first `boxed` with a
    box."""
    (root / "annotations").mkdir(parents=True)
    images = [
        {"id": i + 1, "file_name": f"{i}.jpg", "width": w, "height": h}
        for i, (w, h) in enumerate(sizes)
    ]
    anns = [
        {
            "id": i + 1,
            "image_id": i + 1,
            "category_id": 1,
            "bbox": [1, 1, 8, 8],
            "area": 64,
            "iscrowd": 0,
        }
        for i in range(boxed)
    ]
    from PIL import Image

    for split in ("train2017", "val2017"):
        (root / split).mkdir()
        for entry in images:  # the val images are read before launch (their headers)
            Image.new("RGB", (entry["width"], entry["height"])).save(
                root / split / entry["file_name"]
            )
        coco = {"images": images, "annotations": anns, "categories": [{"id": 1, "name": "thing"}]}
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    return root


def test_a_coco_training_split_smaller_than_one_global_batch(tmp_path):
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    args = [
        "model=fasterrcnn_mobilenet_v3",
        "data=coco",
        "data.num_classes=1",
        "trainer.accelerator=cpu",
    ]
    root = _coco(tmp_path / "few", [(32, 24)] * 4, boxed=3)
    with pytest.raises(
        ConfigError,
        match=r"the training split train2017 has 3 images with a usable box \(1 "
        r"without\), fewer than one global batch data.batch_size=4: lower "
        r"data.batch_size \(e.g. data.batch_size=2\) or add images",
    ):
        load_config(CONFIGS, [*args, f"data.root={root}", "data.batch_size=4"])
    # neither orientation fills a batch: the sampler batches them together (data.sampler)
    root = _coco(tmp_path / "grouped", [(32, 24), (32, 24), (24, 32), (24, 32)], boxed=4)
    load_config(CONFIGS, [*args, f"data.root={root}", "data.batch_size=4"])
    # the batch the refusal names is the largest power of two the images fill
    root = _coco(tmp_path / "suggested", [(32, 24)] * 5 + [(24, 32)] * 3, boxed=8)
    with pytest.raises(ConfigError, match=r"fewer than one global batch .* data\.batch_size=8\)"):
        load_config(CONFIGS, [*args, f"data.root={root}", "data.batch_size=16"])
    load_config(CONFIGS, [*args, f"data.root={root}", "data.batch_size=8"])


def test_a_coco_sets_boxes_past_their_image_unknown_val_categories_and_upscaling_are_said(
    tmp_path, capsys
):
    """An annotation tool's COCO export, checked before launch as the ranks will read it: a box
    reaching past its image is counted and named (training clips it; the evaluation scores the
    val file as written), a val annotation of a category the file does not list is refused here
    (it failed rank 0 at start), and data.min_size scaling 32-px images 25x up is said with the
    sizes that train them as they are."""
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    args = [
        "model=fasterrcnn_mobilenet_v3",
        "data=coco",
        "data.num_classes=1",
        "trainer.accelerator=cpu",
        "data.batch_size=4",
    ]
    root = _coco(tmp_path / "past", [(32, 24)] * 4, boxed=4)
    for split in ("train2017", "val2017"):
        path = root / "annotations" / f"instances_{split}.json"
        coco = json.loads(path.read_text())
        coco["annotations"][1]["bbox"] = [20, 10, 30, 30]  # to x 50, y 40 on 32 x 24
        path.write_text(json.dumps(coco))
    load_config(CONFIGS, [*args, f"data.root={root}"])
    out = capsys.readouterr().out
    assert (
        "instances_train2017.json: 1 box reaches 1 px or more past its image (the first: "
        "annotation 2 of image 2, [20.0, 10.0, 30.0, 30.0] on 32 x 24): training clips them to it"
    ) in out, out
    assert "instances_val2017.json: 1 box reaches" in out and "scores them as written" in out
    assert (
        "data.min_size=800 resizes the training images (shorter side 24-24 px, median 24) 33.3x "
        "up, 1111x their pixels a step; to train them at about their own size: data.min_size=24 "
        "data.max_size=32 (docs/data.md, small sets)"
    ) in out, out
    load_config(CONFIGS, [*args, f"data.root={root}", "data.min_size=32", "data.max_size=48"])
    assert "resizes the training images" not in capsys.readouterr().out

    path = root / "annotations" / "instances_val2017.json"
    coco = json.loads(path.read_text())
    coco["annotations"][0]["category_id"] = 99
    path.write_text(json.dumps(coco))
    with pytest.raises(
        ConfigError,
        match=r"^annotation 1 \(image 1\) has category_id 99, which is not among the categories "
        r"of \S*instances_val2017.json: \[1\]$",
    ):
        load_config(CONFIGS, [*args, f"data.root={root}"])


def test_polygons_as_points_are_said_before_launch_and_a_bad_val_mask_refused(tmp_path, capsys):
    """A mask model on a converter's COCO file: polygons written as [x, y] points are read as
    COCO's form and said in one line; a val instance whose polygon has 2 points is refused before
    any rank starts (COCOeval scores every val mask)."""
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    root = _coco(tmp_path / "points", [(32, 24)] * 4, boxed=4)
    for split in ("train2017", "val2017"):
        path = root / "annotations" / f"instances_{split}.json"
        coco = json.loads(path.read_text())
        for a in coco["annotations"]:
            a["segmentation"] = [[1, 1], [9, 1], [9, 9], [1, 9]]
        path.write_text(json.dumps(coco))
    args = ["model=maskrcnn_mobilenet_v3", "data=coco", "data.num_classes=1",
            "trainer.accelerator=cpu", "data.batch_size=4", "data.min_size=32",
            "data.max_size=32", f"data.root={root}"]  # fmt: skip
    load_config(CONFIGS, args)
    out = capsys.readouterr().out
    assert (
        "instances_train2017.json: 4 polygon segmentations are written as [x, y] points or as "
        "one unwrapped list (the first: annotation 1, [[1, 1], [9, 1], [9, 9], [1, 9]] (points)): "
        "read as COCO's [[x1, y1, x2, y2, ...]]"
    ) in out, out
    assert "instances_val2017.json: 4 polygon segmentations are written" in out
    val = root / "annotations" / "instances_val2017.json"
    coco = json.loads(val.read_text())
    coco["annotations"][2]["segmentation"] = [[1, 1, 9, 9]]
    val.write_text(json.dumps(coco))
    with pytest.raises(ConfigError, match=r"^annotation 3 \(image 3\) of \S*instances_val2017"):
        load_config(CONFIGS, args)


def test_what_is_said_before_launch_heads_the_run_log_and_is_not_said_again(tmp_path, capsys):
    """A Label Studio-like export numbers its annotations from 0: the launcher says before any rank
    starts that scoring numbers them 1-n. Every line said before the run dir existed opens the
    run's log (rank 0's `setup_logging`, from what the launcher hands its ranks), without a second
    print on the console, and the scoring does not say the renumbering again."""
    import logging

    from visiondist.cli import load_config
    from visiondist.evaluation.coco_scoring import ground_truth
    from visiondist.observe.console import setup_logging
    from visiondist.utils.logs import handed_on, said_before

    root = _coco(tmp_path / "from0", [(32, 24)] * 4, boxed=4)
    val = root / "annotations" / "instances_val2017.json"
    coco = json.loads(val.read_text())
    for k, annotation in enumerate(coco["annotations"]):
        annotation["id"] = k
    val.write_text(json.dumps(coco))
    args = ["model=fasterrcnn_mobilenet_v3", "data=coco", "data.num_classes=1",
            "trainer.accelerator=cpu", "data.batch_size=4", f"data.root={root}"]  # fmt: skip
    load_config(CONFIGS, args)
    renumbered = (
        f"{val}: its 4 annotation ids scored as 1-4 (they are not all positive whole numbers; "
        "COCO's scoring reads id 0 as unmatched)"
    )
    out = capsys.readouterr().out
    assert renumbered in out and "data.min_size=800 resizes the training images" in out, out
    said = [line for _, line in said_before()]
    assert renumbered in said and any(line.startswith("data.min_size=800") for line in said)

    root_logger = logging.getLogger()
    handlers, level = list(root_logger.handlers), root_logger.level
    try:
        with handed_on():
            assert said_before() and all(line in said for _, line in said_before())
            (tmp_path / "run").mkdir()
            setup_logging(tmp_path / "run", is_main=True)
            ground_truth(val)  # the first evaluation
            for handler in root_logger.handlers:
                handler.flush()
    finally:
        for handler in list(root_logger.handlers):
            root_logger.removeHandler(handler)
            handler.close()
        for handler in handlers:
            root_logger.addHandler(handler)
        root_logger.setLevel(level)
    assert not said_before()  # handed on, not kept for a later job of this process
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count(renumbered) == 1 and "data.min_size=800 resizes" in log, log
    assert renumbered not in capsys.readouterr().out  # the console said it once, before


# -- 6: a layout for GPUs on a machine without one -------------------------------------------------

ESTIMATE = (
    r"about ([\d.]+) (ms|s|min|h) per step, ([\d.]+) (s|min|h|days) for the 279 steps "
    r"\(trainer.max_epochs=3 of 93 steps ends the run\) \(the time model at this CPU's [\d.]+ "
    r"GFLOP/s dense matmul rate, measured now, shared by 4 ranks: an estimate\)"
)
SECONDS = {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "days": 86400.0}


def test_a_gpu_layout_without_a_gpu_stops_before_any_rank_with_its_estimate(
    tmp_path, capsys, monkeypatch
):
    """`python tools/train.py model=vit_huge parallel=tp4` (trainer.accelerator=auto) where no GPU
    is visible: one line saying so, with the time model's step and whole-run time on this CPU and
    the setting that runs it anyway."""
    import visiondist.launch.ranks

    monkeypatch.setattr(visiondist.launch.ranks, "cuda_device_count", lambda: 0)
    line = _refused(capsys, tmp_path, "train", "model=vit_huge", "parallel=tp4")
    assert line.startswith(
        "error: no GPU was found, so trainer.accelerator=auto would run vit_huge on 4 ranks "
        "(dp=1 tp=4 pp=1) as 4 processes on this machine's CPU: about "
    ), line
    assert line.endswith(
        "; to run it here anyway add trainer.accelerator=cpu (or run it where GPUs are visible)"
    )
    step, unit, total, total_unit = re.search(ESTIMATE, line).groups()
    per_step = float(step) * SECONDS[unit]
    assert per_step > 1.0  # ViT-H/14 at batch 64 on 4 processes sharing this CPU
    assert float(total) * SECONDS[total_unit] == pytest.approx(279 * per_step, rel=0.01)


def test_the_cpu_estimate_follows_the_layout_and_the_run_length(tmp_path, capsys):
    from visiondist.config import ConfigError, compose
    from visiondist.launch.estimate import (
        check_gpu_layout,
        cpu_estimate,
        run_steps,
        step_seconds_on_cpu,
    )
    from visiondist.plan import resolve

    cfg = compose(CONFIGS, ["model=vit_huge", "parallel=tp4"])
    run = resolve(cfg, {}, 0)[0]
    assert run.accelerator == "cpu" and run.world_size == 4
    with pytest.raises(ConfigError, match="no GPU was found"):
        check_gpu_layout(cfg, run)
    check_gpu_layout(cfg, run, "eval")  # no estimate: said, not refused
    assert capsys.readouterr().err == (
        "warning: no GPU was found, so trainer.accelerator=auto runs vit_huge on 4 ranks (dp=1 "
        "tp=4 pp=1) as 4 processes on this machine's CPU (trainer.accelerator=cpu says this is "
        "meant)\n"
    )
    # the same line again in this process (Python's run.evaluate()): said once
    check_gpu_layout(cfg, run, "eval")
    assert capsys.readouterr().err == ""
    # well under an hour: said, then run
    short = OmegaConf.merge(cfg, {"trainer": {"max_steps": 1}})
    check_gpu_layout(short, run)
    assert re.search(
        r"^warning: no GPU was found, so trainer.accelerator=auto runs vit_huge .* per step, .* "
        r"for the 1 steps \(trainer.max_steps=1 ends the run\)",
        capsys.readouterr().err,
        re.M,
    )
    explicit = compose(CONFIGS, ["model=vit_huge", "parallel=tp4", "trainer.accelerator=cpu"])
    check_gpu_layout(explicit, resolve(explicit, {}, 0)[0])  # asked for: runs
    # the default job, one rank on the CPU: nothing said
    default = compose(CONFIGS, [])
    check_gpu_layout(default, resolve(default, {}, 0)[0])
    assert capsys.readouterr().err == ""
    # ...unless its run would take hours there: refused as several ranks are
    one = compose(CONFIGS, ["model=vit_huge"])
    with pytest.raises(
        ConfigError, match=r"vit_huge on 1 rank as one process on this machine's CPU"
    ):
        check_gpu_layout(one, resolve(one, {}, 0)[0])
    # a short one of the same model: nothing said
    check_gpu_layout(OmegaConf.merge(one, {"trainer": {"max_steps": 1}}), resolve(one, {}, 0)[0])
    assert capsys.readouterr().err == ""
    torchrun = {
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "TORCHELASTIC_RUN_ID": "x",
    }
    check_gpu_layout(cfg, resolve(cfg, torchrun, 0)[0])  # the user started these ranks

    # half the rate per rank: at least the compute doubles; the run is 279 steps (6000 images / 64,
    # 3 epochs)
    fast, slow = step_seconds_on_cpu(cfg, run, 0.02), step_seconds_on_cpu(cfg, run, 0.01)
    assert 1.8 * fast < slow < 2.0 * fast + 1e-9
    assert run_steps(cfg) == (279, "trainer.max_epochs=3 of 93 steps ends the run")
    assert run_steps(OmegaConf.merge(cfg, {"trainer": {"max_steps": 50}})) == (
        50,
        "trainer.max_steps=50 ends the run",
    )
    # max_steps sets the run's length past max_epochs' too: as many epochs as it takes
    assert run_steps(OmegaConf.merge(cfg, {"trainer": {"max_steps": 500}})) == (
        500,
        "trainer.max_steps=500 ends the run",
    )
    assert cpu_estimate(cfg, run, tflops=0.08).startswith(
        f"about {_duration(step_seconds_on_cpu(cfg, run, 0.02))} per step, "
    )
    assert "(the time model at this CPU's 80 GFLOP/s" in cpu_estimate(cfg, run, tflops=0.08)
    # its own step count: no whole run
    assert "per step (" in cpu_estimate(cfg, run, "benchmark", tflops=0.08)


def _duration(seconds):
    from visiondist.launch.estimate import duration

    return duration(seconds)


# -- 7: loader workers from the cores per rank -----------------------------------------------------


def test_loader_workers_follow_the_cores_per_rank(monkeypatch):
    import visiondist.data.workers as world
    from visiondist.cli import load_config
    from visiondist.config import ConfigError
    from visiondist.data.loaders import loader_options

    loader_workers = world.loader_workers
    # (8, 112): a DGX H100, 14 cores per GPU, 13 workers each; (1, 64): capped at 16
    assert [
        loader_workers(-1, ranks, cores)
        for ranks, cores in ((1, 2), (2, 2), (4, 2), (2, 8), (8, 112), (1, 64))
    ] == [1, 0, 0, 3, 13, 16]
    assert loader_workers(5, 4, 2) == 5 and loader_workers(0, 1, 64) == 0  # a count given is kept

    cfg = load_config(CONFIGS, ["data=imagenet", "data.root=/data"], inputs=None)
    assert cfg.data.num_workers == -1  # the shipped default
    monkeypatch.setattr(world, "usable_cores", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # the rank's node runs 2 ranks
    options = loader_options(
        OmegaConf.create({"num_workers": -1, "pin_memory": False, "prefetch_factor": 2}), False
    )
    assert (options["num_workers"], options["persistent_workers"], options["prefetch_factor"]) == (
        3,
        True,
        2,
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    options = loader_options(
        OmegaConf.create({"num_workers": -1, "pin_memory": False, "prefetch_factor": 2}), False
    )
    assert (options["num_workers"], options["persistent_workers"], options["prefetch_factor"]) == (
        0,
        False,
        None,
    )
    with pytest.raises(
        ConfigError,
        match=r"data.num_workers=-2: use a count of loader workers per rank, 0 .* or -1",
    ):
        load_config(CONFIGS, ["data.num_workers=-2"], inputs=None)


def test_the_automatic_worker_count_is_said_once_a_process(monkeypatch, caplog):
    """A job builds several loaders (train and val; a prediction per call): one line."""
    import logging

    from visiondist.data import loaders

    monkeypatch.setattr(loaders, "_SAID", set())
    with caplog.at_level(logging.INFO, logger="visiondist.data.loaders"):
        counts = {loaders._num_workers(-1) for _ in range(3)}
    assert len(counts) == 1 and caplog.text.count("data.num_workers=-1: ") == 1


def test_an_srun_task_bound_to_its_own_cpus_does_not_share_them(monkeypatch):
    """tools/slurm_train.sh: srun starts one task per rank with --cpus-per-task=12, each bound to
    12 CPUs of its own. Those are the rank's, not its node's 8 ranks' (12 // 8 - 1 = 0 loader
    workers and 1 thread before); one torchrun per node (its ranks inherit one task's CPUs) and a
    self-launch still share theirs."""
    import visiondist.data.workers as workers
    import visiondist.utils.procenv as procenv
    from visiondist.data.loaders import loader_options

    monkeypatch.setattr(procenv, "_affinity", lambda: 12)
    monkeypatch.setattr(workers, "usable_cores", lambda: 12)
    slurm = {"SLURM_CPUS_PER_TASK": "12", "SLURM_STEP_NUM_TASKS": "16", "WORLD_SIZE": "16"}
    for key, value in {**slurm, "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(key, value)
    assert procenv.ranks_sharing_cpus(8) == 1
    options = loader_options(
        OmegaConf.create({"num_workers": -1, "pin_memory": False, "prefetch_factor": 2}), False
    )
    assert options["num_workers"] == 11
    # one torchrun per node under srun: 2 tasks, 16 ranks sharing each task's CPUs
    assert procenv.ranks_sharing_cpus(8, {**slurm, "SLURM_STEP_NUM_TASKS": "2"}) == 8
    # srun did not bind the task (its affinity is the node's 96 CPUs)
    monkeypatch.setattr(procenv, "_affinity", lambda: 96)
    assert procenv.ranks_sharing_cpus(8, slurm) == 8
    assert procenv.ranks_sharing_cpus(8, {}) == 8  # a self-launch


def test_an_image_size_between_patch_multiples_is_said_before_launch(tmp_path, capsys):
    """data.img_size=72 for a /16 ViT: the model reads 64 px images; said in one line before any
    rank starts (the training is what the line says: the config's model.img_size)."""
    from visiondist.cli import load_config

    root = _imagenet(tmp_path / "set", {"a": 4, "b": 4}, {"a": 1, "b": 1})
    args = [*TRAIN, f"data.root={root}", "data.batch_size=4", "data.img_size=72"]
    cfg = load_config(CONFIGS, args, "train")
    assert cfg.model.img_size == 64
    said = capsys.readouterr().out
    assert (
        "data.img_size=72 is not a multiple of model=vit_tiny's 16 px patch: the ViT reads 64 px "
        "images (model.img_size=64); data.img_size=64 or 80 to choose"
    ) in said
    load_config(CONFIGS, [*args[:-1], "data.img_size=80"], "train")
    assert "not a multiple" not in capsys.readouterr().out
