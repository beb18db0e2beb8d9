"""Named recipes (`experiment=`) against docs/recipes.md, the detector schedule, torchvision's
backbone layout and the decay groups. Sweeps and run directories:
tests/multirank/test_experiments.py."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO

CONFIGS = REPO / "configs"


def _compose(*overrides: str):
    from visiondist.cli import load_config

    return load_config(CONFIGS, list(overrides), inputs=None)  # no data on disk


def _doc_rows(name: str) -> list[tuple[str, object]]:
    """(config key, value) of the `visiondist` columns of docs/recipes.md's table for experiment
    `name`: rows whose value is a number, a boolean, a list or one word (prose is a remark, not a
    value)."""
    text = (REPO / "docs" / "recipes.md").read_text()
    section = text.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not re.fullmatch(r"`[a-z_]+\.[a-z_]+`", cells[2]):
            continue
        value = yaml.safe_load(cells[3])
        if isinstance(value, str) and " " in value:
            continue
        rows.append((cells[2].strip("`"), value))
    return rows


@pytest.mark.parametrize("name, least", [("frcnn_r50_coco_1x", 20), ("vit_b16_imagenet", 18)])
def test_experiment_matches_its_recipe_table(name, least):
    """Every value docs/recipes.md lists next to the published recipe is what `experiment=<name>`
    composes to."""
    cfg = _compose(f"experiment={name}", "data.root=/data")
    rows = _doc_rows(name)
    assert len(rows) >= least, rows
    for key, value in rows:
        group, field = key.split(".")
        got = cfg[group][field]
        got = list(got) if hasattr(got, "__len__") and not isinstance(got, str) else got
        assert got == value, f"{name}: {key} is {got!r}, docs/recipes.md says {value!r}"
    # the command line still wins over the recipe
    assert _compose(f"experiment={name}", "data.root=/data", "optim.lr=0.5").optim.lr == 0.5


def test_frcnn_recipe_schedule_steps_at_epochs_16_and_22():
    """torchvision's MultiStepLR([16, 22]) over 26 epochs after a 1000-iteration linear warm-up from
    1/1000."""
    from visiondist.engine.optim import lr_factor

    s = _compose("experiment=frcnn_r50_coco_1x", "data.root=/data").schedule
    per_epoch = 7330  # COCO train2017 (117,266 images with boxes) at 16 per step
    total = 26 * per_epoch
    assert lr_factor(0, total, s) == pytest.approx(0.001)
    assert lr_factor(500, total, s) == pytest.approx(0.001 + 0.999 * 0.5)
    assert lr_factor(1000, total, s) == 1.0
    assert lr_factor(16 * per_epoch - 1, total, s) == 1.0
    assert lr_factor(16 * per_epoch, total, s) == pytest.approx(0.1)
    assert lr_factor(22 * per_epoch - 1, total, s) == pytest.approx(0.1)
    assert lr_factor(22 * per_epoch, total, s) == pytest.approx(0.01)


def test_backbone_weights_build_torchvisions_pretrained_backbone_layout(tmp_path):
    """`model.backbone_weights` gives what torchvision builds for `weights_backbone`: the file's
    tensors in the backbone, FrozenBatchNorm2d, conv1 + layer1 frozen (3 trainable stages), and the
    same state-dict keys."""
    from torchvision.models import resnet50
    from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
    from torchvision.models.detection.faster_rcnn import FasterRCNN
    from torchvision.ops.misc import FrozenBatchNorm2d

    from visiondist.models import build_model

    torch.manual_seed(0)
    imagenet = resnet50()
    with torch.no_grad():
        imagenet.bn1.running_mean.uniform_()
    path = tmp_path / "resnet50.pth"
    torch.save(imagenet.state_dict(), path)
    cfg = _compose(
        "experiment=frcnn_r50_coco_1x",
        "data.root=/data",
        "data.num_classes=3",
        f"model.backbone_weights={path}",
    ).model
    model = build_model(cfg)
    body = model.backbone.body
    torch.testing.assert_close(body.conv1.weight, imagenet.conv1.weight)
    torch.testing.assert_close(body.layer3[0].conv2.weight, imagenet.layer3[0].conv2.weight)
    torch.testing.assert_close(body.bn1.running_mean, imagenet.bn1.running_mean)
    assert isinstance(body.bn1, FrozenBatchNorm2d) and isinstance(
        body.layer4[2].bn3, FrozenBatchNorm2d
    )

    reference = FasterRCNN(
        _resnet_fpn_extractor(resnet50(norm_layer=FrozenBatchNorm2d), 3), num_classes=4
    )
    assert model.state_dict().keys() == reference.state_dict().keys()
    ours = {n: p.requires_grad for n, p in model.named_parameters()}
    theirs = {n: p.requires_grad for n, p in reference.named_parameters()}
    assert (
        ours == theirs
        and not ours["backbone.body.layer1.0.conv1.weight"]
        and ours["backbone.body.layer2.0.conv1.weight"]
    )

    with pytest.raises(Exception, match="backbone_weights is for the ResNet-50 FPN detectors"):
        _compose(
            "model=fasterrcnn_mobilenet_v3", "data=shapes_coco", f"model.backbone_weights={path}"
        )
    torch.save({"conv1.weight": imagenet.conv1.weight}, tmp_path / "partial.pth")
    with pytest.raises(ValueError, match="is not a resnet50 state dict: missing"):
        build_model(
            _compose(
                "experiment=frcnn_r50_coco_1x",
                "data.root=/data",
                "data.num_classes=80",
                f"model.backbone_weights={tmp_path / 'partial.pth'}",
            ).model
        )


def test_decay_norm_bias_puts_every_parameter_in_the_decay_group():
    from visiondist.engine.optim import param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    default, every = param_groups(model, 0.1), param_groups(model, 0.1, decay_norm_bias=True)
    assert [len(g["params"]) for g in default] == [1, 3]
    assert [len(g["params"]) for g in every] == [4, 0] and every[0]["weight_decay"] == 0.1


def test_run_dirs_started_in_the_same_second_never_collide(tmp_path):
    from visiondist.launch import unique_dir

    made: list[Path] = []
    threads = [threading.Thread(target=lambda: made.append(unique_dir(tmp_path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(made)) == 8 and all(p.is_dir() for p in made)


def test_a_run_dir_a_running_job_holds_is_refused_to_a_second_job(tmp_path):
    """Two jobs given one trainer.run_dir at once: the second stops before it writes anything,
    naming the holder; once the first job's block ends, the directory is free again."""
    import os
    import socket

    from visiondist.config import ConfigError
    from visiondist.launch.rundir import new_run_dir, run_dirs_released

    run = tmp_path / "same"
    cfg = _compose("model=vit_tiny", f"trainer.run_dir={run}")
    with run_dirs_released():
        assert new_run_dir(cfg) == run.resolve()
        held = (run / ".running").read_text()
        assert held.startswith(f"pid {os.getpid()} on {socket.gethostname()}, since ")
        # a second job (its own open of the file: another process's, as the lock sees it)
        from visiondist.launch import rundir

        first = rundir._HELD.copy()
        rundir._HELD.clear()
        try:
            with pytest.raises(
                ConfigError,
                match=rf"^trainer.run_dir={run} is in use by another job \(pid {os.getpid()} on "
                r".*\): wait for it to end, or give this one another trainer.run_dir$",
            ):
                new_run_dir(cfg)
        finally:
            rundir._HELD.update(first)
        assert sorted(p.name for p in run.iterdir()) == [".running", "config.yaml"]
    with run_dirs_released():  # the first job ended: the run continues (trainer.resume=auto)
        assert new_run_dir(cfg) == run.resolve()
