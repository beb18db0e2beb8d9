"""Weights files against the model, through the tools' `main(argv)` before any rank starts: a ViT of
another shape names the model config of the file's shape (our keys and timm's), a classifier of
another size names the class count, a file with no tensor name in common says what it holds, a
checkpoint directory is for evaluation; and tools/eval.py evaluates transformers' from_pretrained
folder (format=hf's model_hf/) as training reads it."""

import json
import re

import pytest
import torch
from helpers import REPO, call_tool

CONFIGS = REPO / "configs"
SHAPES = [
    "data.img_size=32",
    "data.num_workers=0",
    "trainer.progress=false",
    "trainer.accelerator=cpu",
    "trainer.loggers=[csv]",
]


def _refused(capsys, tmp_path, tool, *argv):
    """The one `error:` line of a tool stopped before launch (exit 2), with nothing written under
    its output dir."""
    out = tmp_path / "out"
    code, stdout, err = call_tool(
        capsys, tool, *argv, f"data.root={tmp_path / 'shapes'}", f"trainer.output_dir={out}"
    )
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (stdout[-2000:], err)
    assert not out.exists()
    return err[0]


def _vit_file(path, *overrides, timm=False):
    """A freshly initialised ViT's weights at 32 px (`timm`: in timm's keys, as format=safetensors
    exports them)."""
    from visiondist.cli import load_config
    from visiondist.models import build_model
    from visiondist.models.vit import to_timm_state_dict
    from visiondist.models.weights import save_weights

    cfg = load_config(CONFIGS, [*overrides, "data.img_size=32"], inputs=None)
    state = build_model(cfg.model).state_dict()
    save_weights(to_timm_state_dict(state) if timm else state, path)
    return path


@pytest.mark.parametrize("timm", [False, True], ids=["ours", "timm"])
def test_a_vit_tiny_file_into_vit_small_names_vit_tiny(tmp_path, capsys, timm):
    weights = _vit_file(tmp_path / "tiny.safetensors", "model=vit_tiny", timm=timm)
    line = _refused(
        capsys, tmp_path, "train", "model=vit_small", f"model.weights={weights}", *SHAPES
    )
    assert line == (
        f"error: model.weights={weights} is a vit_tiny (width 192, depth 12, patch 16, 6 classes) "
        "but model=vit_small is 384 wide: use model=vit_tiny"
    )
    # a setting given on the command line stays when the model config changes: the fix names it too
    line = _refused(
        capsys,
        tmp_path,
        "train",
        "model=vit_base",
        "model.depth=2",
        f"model.weights={weights}",
        *SHAPES,
    )
    assert line.endswith(
        "but model=vit_base is 768 wide, 2 blocks deep: use model=vit_tiny model.depth=12"
    ), line


def test_only_the_class_count_differs(tmp_path, capsys):
    weights = _vit_file(
        tmp_path / "w.safetensors", "model=vit_tiny", "model.depth=1", "data.num_classes=4"
    )
    line = _refused(
        capsys,
        tmp_path,
        "train",
        "model=vit_tiny",
        "model.depth=1",
        f"model.weights={weights}",
        *SHAPES,
    )
    assert line == (
        f"error: model.weights={weights} is a 4-class vit_tiny but data.num_classes=6: set "
        "data.num_classes=4 (and use data with those 4 classes)"
    )


def test_the_class_count_fix_names_the_key_the_user_set(tmp_path, capsys):
    weights = _vit_file(
        tmp_path / "w.safetensors", "model=vit_tiny", "model.depth=1", "data.num_classes=4"
    )
    line = _refused(
        capsys,
        tmp_path,
        "train",
        "model=vit_tiny",
        "model.depth=1",
        "model.num_classes=10",
        f"model.weights={weights}",
        *SHAPES,
    )
    assert line == (
        f"error: model.weights={weights} is a 4-class vit_tiny but model.num_classes=10: set "
        "model.num_classes=4"
    )


def test_an_exported_graph_or_a_pickle_of_objects_is_named_not_unpickled(tmp_path, capsys, recwarn):
    """An export's ONNX graph or TorchScript archive given as weights: what it is and the file to
    give instead, and no torch warning; a pickle of objects: refused without torch's advice to
    unpickle it."""
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"\x08\x07\x12\x07pytorch")  # the first bytes of a torch.onnx file
    line = _refused(capsys, tmp_path, "train", f"model.weights={onnx}", *SHAPES)
    assert line == (
        f"error: model.weights={onnx} is an ONNX graph (tools/export.py format=onnx), which runs "
        "the model but is not read as weights: give a weights file, e.g. <run>/model.safetensors "
        "or tools/export.py's model.safetensors"
    )
    script = tmp_path / "model.pt"
    torch.jit.save(torch.jit.trace(torch.nn.Linear(2, 2), torch.zeros(1, 2)), str(script))
    recwarn.clear()
    line = _refused(capsys, tmp_path, "train", f"model.weights={script}", *SHAPES)
    assert "is a TorchScript archive (tools/export.py format=torchscript)" in line, line
    assert not [w for w in recwarn if "TorchScript" in str(w.message)], [
        str(w.message) for w in recwarn
    ]
    program = tmp_path / "model.pt2"
    torch.export.save(
        torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),)), str(program)
    )
    line = _refused(capsys, tmp_path, "train", f"model.weights={program}", *SHAPES)
    assert "is a torch.export program (tools/export.py format=pt2)" in line, line
    objects = tmp_path / "objects.pt"
    # a whole module: unpickling it would run its class
    torch.save({"model": torch.nn.Linear(2, 2)}, objects)
    line = _refused(capsys, tmp_path, "train", f"model.weights={objects}", *SHAPES)
    assert (
        "is a pickle holding more than tensors, which is never unpickled here" in line
        and "Re-running" not in line
    )


def test_a_file_with_no_name_in_common_says_what_it_holds(tmp_path, capsys):
    weights = _vit_file(tmp_path / "w.safetensors", "model=vit_small", "model.depth=2")
    line = _refused(
        capsys,
        tmp_path,
        "train",
        "model=fasterrcnn_mobilenet_v3",
        "data=shapes_coco",
        f"model.weights={weights}",
        "trainer.accelerator=cpu",
    )
    assert line.startswith(
        f"error: model.weights={weights} has no tensor name in common with "
        "model=fasterrcnn_mobilenet_v3 (the file's: "
    ), line
    assert line.endswith(
        "it holds a ViT (width 384, depth 2, patch 16, 6 classes): use model=vit_small "
        "model.depth=2"
    ), line


def test_a_mask_models_weights_under_its_box_twin_name_the_model_their_record_names(
    tmp_path, capsys
):
    """An exported Mask R-CNN's model.safetensors given to its box twin: the mask head's tensors are
    not the model's, and the fix names the model its model.json records."""
    from visiondist.cli import load_config
    from visiondist.models import build_model
    from visiondist.models.weights import save_weights

    cfg = load_config(
        CONFIGS, ["model=maskrcnn_mobilenet_v3", "data=shapes_coco", "data.num_classes=6"],
        inputs=None,
    )  # fmt: skip
    weights = tmp_path / "model.safetensors"
    save_weights(build_model(cfg.model).state_dict(), weights)
    (tmp_path / "model.json").write_text(json.dumps({"model": "maskrcnn_mobilenet_v3"}))
    line = _refused(
        capsys,
        tmp_path,
        "train",
        "model=fasterrcnn_mobilenet_v3",
        "data=shapes_coco",
        f"model.weights={weights}",
    )
    assert "are not the model's (roi_heads.mask_head" in line, line
    assert line.endswith(
        "use the model the weights were trained with, model=maskrcnn_mobilenet_v3 as model.json "
        "records it"
    ), line


def test_a_checkpoint_directory_is_for_evaluation(tmp_path, capsys):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_4"
    checkpoint.mkdir(parents=True)
    (checkpoint / ".metadata").write_bytes(b"")
    (checkpoint / "trainer_state.json").write_text("{}")
    line = _refused(capsys, tmp_path, "train", f"model.weights={checkpoint}", *SHAPES)
    assert line == (
        f"error: model.weights={checkpoint} is a checkpoint directory: training starts from a "
        "weights file (<run>/model.safetensors, or python tools/export.py run_dir=<run> "
        f"step=<N>), or continues that run with trainer.resume={checkpoint}"
    )


DFINE = [
    "model=dfine_n",
    "model.img_size=128",
    "model.multi_scale=null",
    "model.num_queries=20",
    "data=shapes_coco",
    "data.synthetic.train_images=8",
    "data.synthetic.val_images=3",
    "data.batch_size=4",
    "data.num_workers=0",
    "trainer.progress=false",
    "trainer.accelerator=cpu",
]


@pytest.fixture(scope="module")
def dfine_export(tmp_path_factory):
    """A fresh 6-class D-FINE-N at 128 px as format=hf exports it: model_hf/ (config.json,
    model.safetensors, ...)."""
    pytest.importorskip("transformers")
    from omegaconf import OmegaConf

    from visiondist.models.detr_library import build_detr, save_library_dir

    torch.manual_seed(0)
    cfg = OmegaConf.create(
        {
            "name": "dfine_n",
            "arch": "dfine_n",
            "num_classes": 6,
            "img_size": 128,
            "kwargs": {},
            "num_queries": 20,
            "weights": None,
            "multi_scale": None,
        }
    )
    out = tmp_path_factory.mktemp("export") / "model_hf"
    save_library_dir(
        build_detr(cfg), out, ["circle", "square", "triangle", "star", "cross", "ring"]
    )
    return out


@pytest.mark.timeout(600)  # a D-FINE-N evaluation beside another worker's ranks on 2 cores
def test_detr_weights_file_of_an_hf_export_and_eval_of_the_folder(tmp_path, capsys, dfine_export):
    """model.weights=<model_hf>/model.safetensors (the library's key names) is refused naming the
    folder, in training and in tools/eval.py (under its own key); tools/eval.py weights=<model_hf>
    evaluates it."""
    file = dfine_export / "model.safetensors"
    fix = f"give the directory: model.weights={dfine_export}"
    line = _refused(capsys, tmp_path, "train", *DFINE, f"model.weights={file}")
    assert line == (
        f"error: model.weights={file} is the weights file of transformers' from_pretrained "
        "directory of a d_fine model, in the library's key names, none of which model=dfine_n "
        f"has: {fix}"
    )
    line = _refused(capsys, tmp_path, "eval", *DFINE, f"weights={file}")
    assert line.startswith(f"error: weights={file} is the weights file"), line
    assert line.endswith(f"give the directory: weights={dfine_export}"), line

    out = tmp_path / "eval"
    code, stdout, err = call_tool(
        capsys,
        "eval",
        *DFINE,
        f"weights={dfine_export}",
        f"data.root={tmp_path / 'coco'}",
        f"trainer.output_dir={out}",
    )
    assert code == 0, (stdout[-3000:], err)
    (result,) = (out / "eval").glob("*/eval.json")
    metrics = json.loads(result.read_text())
    assert metrics["weights"] == str(dfine_export.resolve()) and metrics["val_count"] == 3
    assert "val box mAP@[.5:.95]:" in stdout
    # a training layout's choice: nothing an evaluation can act on
    assert "parallel=auto chose" not in stdout
    assert re.search(
        r"eval dir: .* \(eval\.json, per_class\.json, detections\.json, .*\.png.*, eval\.log\)",
        stdout,
    ), stdout[-2000:]


def test_prediction_from_an_export_takes_its_class_count_evaluation_asks_for_data(tmp_path, capsys):
    """A 4-class export predicted with nothing but weights= and a source: the file's count, not the
    default data's 6 (prediction reads no data); an evaluation reads data, whose count stays the
    data's; a count or data given wins."""
    from visiondist.models.exported import recorded_settings

    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    record = {"model": "vit_tiny", "task": "classification", "classes": ["a", "b", "c", "d"]}
    (tmp_path / "model.json").write_text(json.dumps(record))
    assert recorded_settings(weights, [], "predict.py", data_needed=False) == [
        "model=vit_tiny",
        "data.num_classes=4",
    ]
    assert "model=vit_tiny data.num_classes=4 as model.json records it" in capsys.readouterr().out
    assert recorded_settings(weights, [], "eval.py") == ["model=vit_tiny"]
    for given in ("data=imagenet", "data.num_classes=4", "model.num_classes=4"):
        assert recorded_settings(weights, [given], "predict.py", data_needed=False) == [
            "model=vit_tiny"
        ]
    # a detector's count is its own business (its labels and category ids)
    (tmp_path / "model.json").write_text(json.dumps({**record, "model": "fasterrcnn_r50"}))
    assert recorded_settings(weights, [], "predict.py", data_needed=False) == [
        "model=fasterrcnn_r50"
    ]
