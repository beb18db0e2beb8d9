"""Bad input stops the real CLI before any rank starts: exit code 2, one `error:` line that names
the fix, no traceback, no run directory. Then the fixes that keep going instead: position embeddings
resampled for fine-tuning, a sweep that runs past a failed job, weights files with the usual mode, a
progress bar while evaluating."""

import json
import time

import pytest
from helpers import REPO, run_cli

CONFIGS = REPO / "configs"


EVAL = REPO / "tools" / "eval.py"


def _coco(root, categories, splits=("train2017", "val2017")):
    """A COCO-format directory with no images: only what the checks before launch read."""
    (root / "annotations").mkdir(parents=True)
    for split in splits:
        (root / split).mkdir()
        cats = [{"id": i + 1, "name": f"c{i}", "supercategory": "x"} for i in range(categories)]
        coco = {"images": [], "annotations": [], "categories": cats}
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    return root


def _imagefolder(root, train_classes, val=True):
    for c in range(train_classes):
        (root / "train" / f"n{c:08d}").mkdir(parents=True)
        if val:
            (root / "val" / f"n{c:08d}").mkdir(parents=True)
    return root


def _refused(args, out, expected, script=REPO / "tools" / "train.py"):
    start = time.monotonic()
    result = run_cli([*args, f"trainer.output_dir={out}"], timeout=120, script=script)
    seconds = time.monotonic() - start
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout and "[rank" not in result.stdout, result.stdout[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stdout[-3000:]
    assert expected in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())  # no run directory, no config.yaml, no log
    assert seconds < 60, seconds
    return lines[0]


def test_a_mandatory_value_is_asked_for(tmp_path):
    _refused(
        ["data=imagenet"],
        tmp_path / "out",
        "data.root must be set (??? in the config): add data.root=/path/to/imagenet",
    )


def test_a_mandatory_value_of_any_sweep_job_is_asked_for_before_the_first_job(tmp_path):
    line = _refused(["-m", "data=shapes,imagenet"], tmp_path / "out", "data.root must be set")
    assert line.startswith("error: job 1 (data=imagenet ")


@pytest.mark.parametrize(
    "layout,expected",
    [
        ("missing", "no such directory: set data.root to the imagenet dataset's directory"),
        ("empty", "is empty: set data.root to the imagenet dataset's directory"),
        ("no_val", "has no val split"),
    ],
)
def test_b_a_data_root_without_the_data(tmp_path, layout, expected):
    root = tmp_path / "imagenet"
    if layout == "empty":
        root.mkdir()
    elif layout == "no_val":
        _imagefolder(root, 3, val=False)
    _refused(["data=imagenet", f"data.root={root}"], tmp_path / "out", expected)


def test_c_num_classes_must_match_the_class_folders(tmp_path):
    root = _imagefolder(tmp_path / "imagenet", 7)
    _refused(
        ["data=imagenet", f"data.root={root}", "data.num_classes=10"],
        tmp_path / "out",
        f"data.num_classes=10 but {root / 'train'} has 7 class folders: set data.num_classes=7",
    )


def test_c_num_classes_must_match_the_coco_categories(tmp_path):
    root = _coco(tmp_path / "coco", 6)
    _refused(
        ["model=fasterrcnn_mobilenet_v3", "data=coco", f"data.root={root}", "data.num_classes=80"],
        # unset, it would be inferred: 6
        tmp_path / "out",
        "has 6 categories: set data.num_classes=6",
    )


@pytest.fixture(scope="module")
def detector6(tmp_path_factory):
    """The weights of a 6-class detector (shapes_coco's classes), as a training run leaves them."""
    from safetensors.torch import save_file

    from visiondist.cli import load_config
    from visiondist.models import build_model

    cfg = load_config(CONFIGS, ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco"])
    path = tmp_path_factory.mktemp("weights") / "model.safetensors"
    save_file(build_model(cfg.model).state_dict(), str(path))
    return path


def test_d_eval_of_weights_for_other_classes_names_their_class_count(tmp_path, detector6):
    root = _coco(tmp_path / "coco", 80, splits=("val2017",))  # evaluation needs only the val split
    _refused(
        [f"weights={detector6}", "model=fasterrcnn_mobilenet_v3", "data=coco", f"data.root={root}"],
        tmp_path / "out",
        f"error: weights={detector6} is a 6-class fasterrcnn_mobilenet_v3 but "
        "data.num_classes=80: set data.num_classes=6",
        script=EVAL,
    )
