"""The export names what the model predicts: a classifier's class names and a detector's label ->
COCO category id map, in model.json and in the metadata of the safetensors and ONNX files; the ONNX
check names nested val images by their real paths, and reads a shard run's from its shards;
docs/checkpoints.md's scoring by name is right where timm orders the class folders otherwise."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO
from PIL import Image

from visiondist.cli import load_config

# the run's order: code-point sort of the folder names
CLASSES = ["Zebra", "apple", "c10", "c9", "mango", "star"]
# (category id, name) in the annotation file's own order; the loader numbers the ids in increasing
# order
CATEGORIES = [(90, "toothbrush"), (3, "car"), (17, "Cat")]
# file_names with sub-folders, in the file's order
NESTED = ["2024/cam1/a.jpg", "2024/b.jpg", "other/c.jpg"]


def _metadata(onnx_path: Path) -> dict[str, str]:
    """The ONNX file's metadata, read by onnx and by ONNX Runtime (which must agree)."""
    import onnx
    import onnxruntime as ort

    props = {p.key: p.value for p in onnx.load(str(onnx_path)).metadata_props}
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    assert session.get_modelmeta().custom_metadata_map == props
    return props


def _safetensors_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_classifier_exports_carry_the_class_names(tmp_path):
    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.onnx_check import check_onnx
    from visiondist.checkpoint.export.trained import Trained
    from visiondist.models import build_model

    cfg = load_config(REPO / "configs", ["model.depth=1", "model.num_heads=2"], inputs=None)
    torch.manual_seed(0)
    trained = Trained(cfg, build_model(cfg.model).eval(), tmp_path / "step_1", 1, list(CLASSES))
    onnx_path = tmp_path / "vit.onnx"
    export(trained, "onnx", onnx_path)
    meta = _metadata(onnx_path)
    assert json.loads(meta["classes"]) == CLASSES and "labels" not in meta
    # the metadata changes nothing of the graph
    assert check_onnx(trained, onnx_path).max_diff < 1e-4

    files = export(trained, "safetensors", tmp_path / "vit.safetensors")
    assert json.loads(_safetensors_metadata(files[0])["classes"]) == CLASSES
    assert json.loads(files[1].read_text())["classes"] == CLASSES


@pytest.fixture(scope="module")
def nested_coco(tmp_path_factory) -> Path:
    """A COCO-format root: val images under sub-folders, categories with gaps in their ids, out of
    order."""
    root = tmp_path_factory.mktemp("nested_coco")
    rng = np.random.default_rng(0)
    images, annotations = [], []
    for n, name in enumerate(NESTED, start=1):
        (root / "val" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(root / "val" / name)
        images.append({"id": n, "file_name": name, "width": 64, "height": 48})
        annotations.append(
            {
                "id": n,
                "image_id": n,
                "category_id": CATEGORIES[n - 1][0],
                "bbox": [8, 6, 30, 20],
                "area": 600,
                "iscrowd": 0,
            }
        )
    (root / "annotations").mkdir()
    coco = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": cat, "name": name} for cat, name in CATEGORIES],
    }
    for split in ("train", "val"):
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    return root


def _detector(root: Path):
    from visiondist.models import build_model
    from visiondist.models.detection import drop_fp32_hooks

    cfg = load_config(
        REPO / "configs",
        [
            "model=fasterrcnn_mobilenet_v3",
            "data=shapes_coco",
            f"data.root={root}",
            "data.num_classes=3",
            "data.min_size=64",
            "data.max_size=64",
            "+model.kwargs.box_score_thresh=0.0",
        ],
        inputs=None,
    )
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    drop_fp32_hooks(model)
    return cfg, model


def test_detector_exports_map_labels_to_the_annotation_files_category_ids(nested_coco, tmp_path):
    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.trained import Trained, coco_categories
    from visiondist.data.coco import CocoDetection

    cfg, model = _detector(nested_coco)
    loader = CocoDetection(
        nested_coco / "val", nested_coco / "annotations" / "instances_val.json", train=False
    )
    expected = {
        str(label): {"category_id": cat, "name": dict(CATEGORIES)[cat]}
        for label, cat in sorted(loader.cat_of.items())
    }
    # the loader's order: increasing ids
    assert [v["category_id"] for v in expected.values()] == [3, 17, 90]
    # what a checkpoint without the record gets, from the annotation file
    categories, names = coco_categories(cfg)
    assert (categories, names) == ([3, 17, 90], ["car", "Cat", "toothbrush"])

    # a checkpoint's record (trainer_state.json's category_ids) goes to every file as it is
    trained = Trained(cfg, model, tmp_path / "step_2", 2, names, categories)
    files = export(trained, "safetensors", tmp_path / "detector.safetensors")
    assert json.loads(_safetensors_metadata(files[0])["labels"]) == expected
    assert json.loads(files[1].read_text())["labels"] == expected
    onnx_path = tmp_path / "detector.onnx"
    export(trained, "onnx", onnx_path)
    meta = _metadata(onnx_path)
    assert (
        json.loads(meta["labels"]) == expected and "score_thresh" in meta and "classes" not in meta
    )
    # the model it was exported from: what prediction takes where the command names none, and
    # what a refusal names
    assert meta["model"] == json.loads(files[1].read_text())["model"] == "fasterrcnn_mobilenet_v3"
    from visiondist.config import ConfigError
    from visiondist.inference.run import prediction_config

    cfg = prediction_config(None, str(onnx_path), None, [], {"source": str(tmp_path)})
    assert cfg.model.name == "fasterrcnn_mobilenet_v3" and cfg.data.name == "detection"
    with pytest.raises(
        ConfigError,
        match=r"give the model it was exported from, "
        r"model=fasterrcnn_mobilenet_v3 \(detector.json\)",  # the sidecar of the same name
    ):
        prediction_config(None, str(onnx_path), None, ["model=vit_tiny"], {"source": "x"})
    files[1].unlink()  # the graph alone: its own metadata says it
    cfg = prediction_config(None, str(onnx_path), None, [], {"source": str(tmp_path)})
    assert cfg.model.name == "fasterrcnn_mobilenet_v3"


def _run_with_checkpoint(run: Path, cfg, model, record: dict) -> Path:
    """A run dir holding `cfg` and one single-process checkpoint of `model` whose trainer state has
    `record`."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from visiondist.checkpoint.dcp import save_checkpoint

    run.mkdir(parents=True)
    OmegaConf.save(cfg, run / "config.yaml")
    layout = SimpleNamespace(is_main=True, rank=0, world_size=1, dp=1, tp=1, pp=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return save_checkpoint(run, 2, model, optimizer, {"epoch": 0, **record}, layout)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_export_takes_the_category_ids_a_checkpoint_records(nested_coco, tmp_path, caplog):
    """The record wins (here it differs from the data on purpose); a checkpoint without it gets the
    annotation file's, in the loader's order; without either the export carries no map and says
    so."""
    from visiondist.checkpoint.export.preprocessing import label_map, sidecar
    from visiondist.checkpoint.export.trained import load_trained

    cfg, model = _detector(nested_coco)
    recorded = _run_with_checkpoint(
        tmp_path / "recorded", cfg, model, {"classes": ["x", "y", "z"], "category_ids": [5, 6, 7]}
    )
    trained = load_trained(recorded.parents[1])
    assert (trained.step, trained.categories, trained.classes) == (2, [5, 6, 7], ["x", "y", "z"])
    assert sidecar(trained)["labels"] == {
        "1": {"category_id": 5, "name": "x"},
        "2": {"category_id": 6, "name": "y"},
        "3": {"category_id": 7, "name": "z"},
    }

    older = _run_with_checkpoint(
        tmp_path / "older", cfg, model, {"classes": ["car", "Cat", "toothbrush"]}
    )
    assert [v["category_id"] for v in label_map(load_trained(older.parents[1])).values()] == [
        3,
        17,
        90,
    ]

    cfg.data.root = str(tmp_path / "moved")
    elsewhere = _run_with_checkpoint(
        tmp_path / "elsewhere", cfg, model, {"classes": ["car", "Cat", "toothbrush"]}
    )
    trained = load_trained(elsewhere.parents[1])
    assert (
        trained.categories is None
        and label_map(trained) is None
        and "labels" not in sidecar(trained)
    )
    assert "the export carries no label -> category id map" in caplog.text


def _exported_detector(root: Path, tmp_path: Path):
    """(trained detector on the data at `root`, its ONNX file)."""
    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.trained import Trained

    cfg, model = _detector(root)
    trained = Trained(cfg, model, tmp_path / "step_2", 2, ["car", "Cat", "toothbrush"])
    onnx_path = tmp_path / "detector.onnx"
    export(trained, "onnx", onnx_path)
    return trained, onnx_path


def test_onnx_check_names_nested_val_images_by_their_paths(nested_coco, tmp_path):
    from visiondist.checkpoint.export.onnx_check import check_onnx

    check = check_onnx(*_exported_detector(nested_coco, tmp_path))
    folder = nested_coco / "val"
    assert check.example == f"3 val images ({', '.join(NESTED)} in {folder})", check.example
    assert f"on 3 val images ({', '.join(NESTED)} in {folder})" in check.summary()
    named = re.fullmatch(r"3 val images \((.*) in (.*)\)", check.example)
    assert all((Path(named[2]) / name).is_file() for name in named[1].split(", "))


def test_onnx_check_of_a_shard_run_reads_the_val_images_from_the_packed_split(
    nested_coco, tmp_path
):
    """A run trained from shards (data.format=shards) is checked on the val images it evaluated,
    read from the shards (the pack holds no image folder), named by their file names: the same
    detections as from the tree."""
    from visiondist.checkpoint.export.onnx_check import check_onnx
    from visiondist.data.shards.pack import PackOptions
    from visiondist.data.shards.packed_coco import pack_coco

    trained, onnx_path = _exported_detector(nested_coco, tmp_path)
    from_tree = check_onnx(trained, onnx_path)

    packed = tmp_path / "packed"
    splits = {
        s: (nested_coco / "val", nested_coco / "annotations" / f"instances_{s}.json")
        for s in ("train", "val")
    }
    pack_coco(splits, packed, PackOptions(shard_mb=0.01, workers=1, progress=False), nested_coco)
    trained.cfg.data.format, trained.cfg.data.root = "shards", str(packed)
    from_shards = check_onnx(trained, onnx_path)
    assert (
        from_shards.example
        == f"3 val images ({', '.join(NESTED)} from the packed val split of {packed})"
    )
    assert (from_shards.boxes, from_shards.max_diff) == (
        from_tree.boxes,
        from_tree.max_diff,
    ) and from_tree.boxes


def _doc_block(marker: str, doc: str = "checkpoints.md") -> str:
    """The one python block of docs/`doc` that holds `marker`, unindented."""
    text = (REPO / "docs" / doc).read_text()
    blocks = [
        re.sub(r"^  ", "", b, flags=re.M) for b in re.findall(r"```python\n(.*?)```", text, re.S)
    ]
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"docs/{doc}: {len(found)} python blocks with {marker!r}"
    return found[0]


def test_docs_score_by_name_where_timm_orders_the_classes_otherwise(tmp_path, monkeypatch, capsys):
    """Folders with capitals and numbers: timm's ImageDataset numbers them otherwise than the run;
    the docs' code scores a model that is always right at 100%, where comparing indices does not."""
    from timm.data import ImageDataset

    from visiondist.data.imagefolder import scan_image_folder

    folder = tmp_path / "data" / "val"
    for i, name in enumerate(CLASSES):
        (folder / name).mkdir(parents=True)
        for k in range(2):
            Image.new("RGB", (8, 8), (20 + 30 * i, 0, k)).save(folder / name / f"{k}.png")
    assert scan_image_folder(folder)[0] == CLASSES  # the run's indices
    timm_order = ImageDataset(str(folder)).reader.class_to_idx
    assert list(timm_order) == ["apple", "c9", "c10", "mango", "star", "Zebra"]

    # the right class every time: its index in the run's order, from the red level
    class Oracle(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.one_hot(
                ((x[:, 0, 0, 0] - 20) / 30).round().long(), len(CLASSES)
            ).float()

    def transform(image):
        return torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)

    model, info = Oracle(), {"classes": list(CLASSES)}
    by_index = ImageDataset(str(folder), transform=transform)
    index_hits = sum(int(model(image[None]).argmax(1)) == target for image, target in by_index)
    assert index_hits < len(by_index)  # comparing indices: the model seems wrong

    monkeypatch.chdir(tmp_path)
    exec(_doc_block("ImageDataset"), {"info": info, "model": model, "transform": transform})
    assert capsys.readouterr().out.strip() == "top-1 100.00%"

    names = info["classes"]  # the docs' other way: timm numbers the folders in the model's order
    mapped = ImageDataset(
        str(folder), transform=transform, class_map={name: i for i, name in enumerate(names)}
    )
    assert (
        sum(int(model(image[None]).argmax(1)) == target for image, target in mapped)
        == len(mapped)
        == 12
    )
    assert (
        'ImageDataset("data/val", class_map={name: i for i, name in enumerate(names)})'
        in (REPO / "docs" / "checkpoints.md").read_text()
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_hf_export_carries_the_category_ids_and_the_docs_code_maps_labels_to_them(
    nested_coco, tmp_path, capsys
):
    """`tools/export.py format=hf` of a D-FINE-N run on a set whose category ids are 3 / 17 / 90:
    config.json names each 0-based library label and gives its COCO category id (`category_ids`,
    which transformers keeps as `model.config.category_ids`); docs/detection.md's transformers code,
    run on the directory, writes COCO results with those ids; prediction here reads the same map
    from the directory."""
    from helpers import load_tool
    from transformers import AutoConfig

    from visiondist.inference.names import read_names
    from visiondist.models import build_model

    cfg = load_config(
        REPO / "configs",
        [
            "model=dfine_n",
            "model.img_size=64",
            "model.num_queries=10",
            "data=shapes_coco",
            f"data.root={nested_coco}",
            "data.num_classes=3",
            "data.min_size=64",
            "data.max_size=64",
        ],
        inputs=None,
    )
    torch.manual_seed(0)
    run = tmp_path / "run"
    _run_with_checkpoint(
        run,
        cfg,
        build_model(cfg.model).eval(),
        {"classes": ["car", "Cat", "toothbrush"], "category_ids": [3, 17, 90]},
    )
    hf = tmp_path / "model_hf"
    # the command, in-process
    assert load_tool("export").main([f"run_dir={run}", "format=hf", f"out={hf}"]) == 0
    config = json.loads((hf / "config.json").read_text())
    assert config["category_ids"] == [3, 17, 90]
    assert config["id2label"] == {"0": "car", "1": "Cat", "2": "toothbrush"}
    assert AutoConfig.from_pretrained(hf).category_ids == [3, 17, 90]
    # the data is not here: the directory's
    cfg.model.weights, cfg.data.root = str(hf), str(tmp_path / "elsewhere")
    names = read_names(cfg)
    assert (names.classes, names.categories) == (["car", "Cat", "toothbrush"], [3, 17, 90])
    assert names.read_from == str(hf / "config.json")

    # eval.py and predict.py read the model off the directory (its variant by its tensors' shapes,
    # its classes, queries and input size) and ask only for what it cannot say: the data to evaluate
    # on (printed configs: no rank starts in a unit test)
    capsys.readouterr()
    assert load_tool("eval").main([f"weights={hf}"]) == 2
    assert (
        f"weights={hf} is a dfine_n with 3 classes (its config.json says so): give the data to "
        "evaluate it on, e.g. data=coco data.root=<COCO-format root>" in capsys.readouterr().err
    )
    assert (
        load_tool("eval").main(
            [
                f"weights={hf}",
                "data=shapes_coco",
                f"data.root={nested_coco}",
                "model.num_queries=8",
                "--cfg",
                "job",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    printed = yaml.safe_load(out[out.index("model:") :])
    assert (
        printed["model"]["name"],
        printed["model"]["num_classes"],
        printed["model"]["img_size"],
        printed["model"]["num_queries"],
    ) == ("dfine_n", 3, 64, 8)  # the command line wins
    assert (
        f"eval.py weights={hf}: model=dfine_n data.num_classes=3 model.img_size=64 as its "
        "config.json says" in out
    )
    assert (
        load_tool("predict").main(
            [f"weights={hf}", f"source={nested_coco / 'val'}", "--cfg", "job"]
        )
        == 0
    )
    out = capsys.readouterr().out
    printed = yaml.safe_load(out[out.index("model:") :])
    assert (printed["model"]["name"], printed["data"]["name"], printed["model"]["num_classes"]) == (
        "dfine_n",
        "shapes_coco",
        3,
    )
    assert "data=shapes_coco for its settings (prediction reads no data)" in out

    # the docs' code on one of the set's images, its results as COCO would score them
    code = _doc_block("category_ids", "detection.md").replace(
        "outputs/.../export/model_hf", str(hf)
    )
    code = code.replace('"photo.jpg"', repr(str(nested_coco / "val" / NESTED[0])))
    scope = {}
    exec(code, scope)
    results = scope["results"]
    assert results and {r["category_id"] for r in results} <= {3, 17, 90}
    assert all(set(r) == {"image_id", "category_id", "bbox", "score"} for r in results)
    assert all(r["bbox"][2] >= 0 and r["bbox"][3] >= 0 for r in results)


def test_an_export_failure_says_its_first_words_and_the_rest(tmp_path, monkeypatch, capsys):
    """A RuntimeError of the export (torch's own, e.g. TorchScript's, start with an empty line and
    run over several): `error:` with the first line that says something, then the rest indented,
    exit 1; it printed `error: ` and nothing else."""
    from helpers import load_tool

    import visiondist.api.export_job as job

    def failing(*args, **kwargs):
        raise RuntimeError("\n\nCould not compile the model:\n  at line 3\n")

    monkeypatch.setattr(job, "export_job", failing)
    assert load_tool("export").main([f"run_dir={tmp_path}", "format=torchscript"]) == 1
    assert capsys.readouterr().err == "error: Could not compile the model:\n    at line 3\n"


def test_evaluating_weights_on_data_of_other_classes_is_refused(tmp_path):
    """Weights that record their classes (a run's model.safetensors) evaluated on a set with as many
    classes of other names, or the same in another order, would score every label against another
    class (a newcomer saw top-1 0.00%, nothing said): refused before launch, naming both. The same
    classes in the same order pass."""
    from safetensors.torch import save_file

    from visiondist.config import ConfigError
    from visiondist.inference.names import check_same_classes

    weights = tmp_path / "model.safetensors"
    save_file(
        {"head.weight": torch.zeros(3, 4)},
        str(weights),
        metadata={"classes": json.dumps(["bird", "cat", "dog"])},
    )

    def cfg_on(*classes: str):
        root = tmp_path / "-".join(classes)
        for split in ("train", "val"):
            for name in classes:
                (root / split / name).mkdir(parents=True)
                Image.new("RGB", (8, 8)).save(root / split / name / "a.jpg")
        return load_config(
            REPO / "configs",
            ["data=imagenet", f"data.root={root}", f"model.weights={weights}"],
            inputs=None,
        )

    with pytest.raises(
        ConfigError,
        match=r"was trained on classes bird, cat, dog, but the class folders of .* holds "
        r"classes a, b, c: evaluate on data with the classes it was trained for",
    ):
        check_same_classes(cfg_on("a", "b", "c"))
    with pytest.raises(ConfigError, match="holds classes ant, bird, cat, dog"):
        check_same_classes(cfg_on("bird", "cat", "dog", "ant"))
    same = cfg_on("bird", "cat", "dog")
    check_same_classes(same)
    # recorded in another order than the folders sort in: label k is another class there
    save_file(
        {"head.weight": torch.zeros(3, 4)},
        str(weights),
        metadata={"classes": json.dumps(["dog", "cat", "bird"])},
    )
    with pytest.raises(ConfigError, match="holds the same classes in another order"):
        check_same_classes(same)


def test_an_export_beside_another_steps_says_so(tmp_path):
    """<run>/export/ is shared by every export of a run: one of step 100 written beside the
    files of step 50 (and of the same step's EMA) names them, as their records say, and none of
    its own."""
    from types import SimpleNamespace

    from visiondist.api.export_job import _other_sources

    step = tmp_path / "checkpoints"

    def exported(name: str, source: dict) -> None:
        (tmp_path / f"{name}.safetensors").write_bytes(b"weights")
        (tmp_path / f"{name}.json").write_text(json.dumps({"model": "vit_tiny", "source": source}))

    exported("model", {"path": f"{step}/step_50", "step": 50})
    exported("model_ema", {"path": f"{step}/step_100", "step": 100, "weights": "EMA"})
    (tmp_path / "other.json").write_text("[1, 2]")  # not an export's
    trained = SimpleNamespace(source=step / "step_100", step=100, ema=False)
    written = [tmp_path / "model.onnx"]
    assert _other_sources(tmp_path, trained, written) == (
        "model.safetensors from step 50, model_ema.safetensors from step 100 (EMA)"
    )
    exported("model", {"path": f"{step}/step_100", "step": 100})
    assert _other_sources(tmp_path, trained, written) == (
        "model_ema.safetensors from step 100 (EMA)"
    )
