"""One command line for every tool, in process through each tool's `main(argv)`: each tool's --help,
Hydra's keys and flags honoured or refused in one line (exit 2), the old spellings with a
deprecation line, where each kind of job writes, a class count inferred from the class folders. The
runs started as a user would: tests/multirank/test_cli.py."""

import json

import pytest
from helpers import REPO, call_tool, load_tool
from omegaconf import OmegaConf

CONFIGS = REPO / "configs"


TOOLS = ("train", "eval", "export", "plan", "benchmark", "predict")


_tool, _call = load_tool, call_tool


KEYS = {
    "train": (),
    "eval": ("run_dir=<dir>", "step=<N>", "weights=<path>"),
    "plan": (),
    "benchmark": (),
    "export": ("run_dir=<dir>", "step=<N>", "format=<format>", "out=<path>"),
    "predict": (
        "run_dir=<dir>",
        "step=<N>",
        "weights=<path>",
        "source=<path>",
        "out=<dir>",
        "topk=<k>",
        "score_thresh=<s>",
        "max_det=<n>",
        "classes=<a,b>",
        "save_images=<n>",
        "vid_stride=<n>",
        "batch=<n>",
    ),
}


@pytest.mark.parametrize("name", TOOLS)
def test_each_tool_has_its_own_usage_with_its_keys_and_the_group_options(capsys, name):
    code, out, err = _call(capsys, name, "--help")
    assert code == 0 and not err
    assert out.startswith(f"usage: python tools/{name}.py [flags]")
    for key in KEYS[name]:
        assert f"  {key}" in out, key
    assert "reads:" in out and "writes:" in out and "examples:" in out
    if name == "export":  # the run's config.yaml: no group options to pick
        assert "group=option" not in out and "safetensors" in out and "onnx" in out
        return
    groups, last = {}, None
    for line in out.split("The groups and their options:\n")[1].split("\n\n")[0].splitlines():
        # " model vit_22b ...", then wrapped lines of more options
        if not line.startswith("   "):
            last = line.split()[0]
        groups.setdefault(last, []).extend(line.split()[0 if line.startswith("   ") else 1 :])
    assert set(groups) == {
        "model",
        "data",
        "parallel",
        "optim",
        "schedule",
        "trainer",
        "experiment",
    }, groups
    assert {"vit_tiny", "vit_small", "fasterrcnn_r50"} <= set(groups["model"]), groups
    assert groups["parallel"] == sorted(p.stem for p in (CONFIGS / "parallel").glob("*.yaml"))
    assert "imagenet" in groups["data"] and "vit_b16_imagenet" in groups["experiment"]


def test_writes_of_each_tool():
    assert "outputs/eval/<date>_<time>/" in _tool("eval").TOOL.writes
    assert "outputs/benchmark/<date>_<time>/" in _tool("benchmark").TOOL.writes
    assert _tool("plan").TOOL.writes.startswith("nothing")


REFUSED = [
    (
        ("--info",),
        "--info: visiondist composes its config with Hydra but runs no Hydra app: --cfg job",
    ),
    (("--info", "defaults"), "--info:"),
    (("--shell-completion",), "--shell-completion: visiondist installs no shell completion"),
    (
        ("-cn", "other"),
        "-cn: the tools compose configs/train.yaml: pick a recipe with experiment=<name>",
    ),
    (("--config-name=other",), "--config-name: the tools compose configs/train.yaml"),
    (("-cp", "conf"), "-cp: use -cd DIR"),
    (("--hydra-help",), "--hydra-help:"),
    (("-r",), "-r: one run is what a tool does without -m"),
    (
        ("--experimental-rerun", "x.pickle"),
        "--experimental-rerun: to continue a run, give trainer.run_dir=",
    ),
    (
        ("--cfg", "hydra"),
        "--cfg hydra: visiondist composes its config with Hydra but runs no Hydra app",
    ),
    (("--resolve",), "--resolve goes with --cfg"),
    (("-p", "trainer"), "-p goes with --cfg"),
    (("--foo",), "--foo: not a flag of tools/train.py: --help lists them"),
    (
        ("hydra.job.chdir=true",),
        "hydra.job.chdir: visiondist never changes directory; paths are relative to where you run",
    ),
    (
        ("hydra/job_logging=disabled",),
        "hydra/job_logging: visiondist sets up its own logging (the console and the "
        "run dir's train.log): use trainer.progress=false",
    ),
    (("hydra/hydra_logging=disabled",), "hydra/hydra_logging: visiondist sets up its own logging"),
    (("hydra.verbose=true",), "hydra.verbose: visiondist logs INFO on rank 0"),
    (("hydra.output_subdir=null",), "hydra.output_subdir: visiondist writes no .hydra/ folder"),
    (
        ("hydra/launcher=joblib",),
        "hydra/launcher: visiondist starts its own ranks: use parallel.dp=N",
    ),
    (("hydra/sweeper=optuna", "-m"), "hydra/sweeper: -m expands comma-separated values"),
    (("hydra.searchpath=[file:///x]",), "hydra.searchpath: use -cd DIR"),
    (("hydra.mode=MULTIRUN",), "hydra.mode: use -m for a sweep"),
    (
        ("hydra.job.name=x",),
        "hydra.job.name: visiondist composes its config with Hydra but runs no Hydra app",
    ),
    (("+hydra.job.env_set.X=1",), "hydra.job.env_set.X: visiondist composes its config with Hydra"),
    (
        ("hydra.sweep.dir=/tmp/x",),
        "hydra.sweep.dir names the directory of a sweep (-m): for one run use hydra.run.dir=DIR",
    ),
    (
        ("-m", "hydra.run.dir=/tmp/x"),
        "hydra.run.dir: with -m each job goes to <sweep dir>/<job>: use hydra.sweep.dir=DIR",
    ),
    (("-m", "hydra.sweep.subdir=x"), "hydra.sweep.subdir: job k of a sweep goes to <sweep dir>/k"),
    (
        ("hydra.run.dir=/tmp/a", "trainer.run_dir=/tmp/b"),
        "name the same directory: give one of them",
    ),
    (("-cd", "/nonexistent/conf"), "-cd /nonexistent/conf: no such directory"),
    (("max_steps=3",), "max_steps is not a setting: did you mean trainer.max_steps?"),
    # an optional group (None in the schema): its fields from the annotations
    (
        ("data.synthetic.max_aspekt=3",),
        "data.synthetic.max_aspekt is not a setting: did you mean data.synthetic.max_aspect?",
    ),
]


@pytest.mark.parametrize("argv,expected", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_hydra_flags_and_keys_that_would_do_nothing_are_refused_in_one_line(capsys, argv, expected):
    from visiondist.cli import run_tool

    ran = []
    # nothing runs, whatever happens
    code = run_tool(_tool("train").TOOL, CONFIGS, list(argv), ran.append)
    out = capsys.readouterr()
    err = [line for line in out.err.splitlines() if line.strip()]
    assert code == 2 and not ran and not out.out, out
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert expected in err[0], err[0]


@pytest.mark.parametrize(
    "name,argv,expected",
    [
        ("plan", ["hydra.run.dir=/tmp/x"], "hydra.run.dir: tools/plan.py writes no run directory"),
        (
            "predict",
            ["weights=absent.safetensors", "source=a.jpg", "hydra.run.dir=/tmp/x"],
            "hydra.run.dir: tools/predict.py writes no run directory (out=<path> names where it "
            "writes)",
        ),
        (
            "predict",
            ["weights=absent.safetensors", "source=a.jpg", "trainer.run_dir=/tmp/x"],
            "trainer.run_dir= places a training or evaluation run; a prediction's folder is "
            "out=<dir> (default: <run>/predict/<date>_<time>/): give out= instead",
        ),
        (
            "export",
            ["run_dir=/tmp", "hydra.run.dir=/tmp/x"],
            "tools/export.py writes no run directory (out=<path>",
        ),
        (
            "export",
            ["run_dir=/tmp", "model.depth=2"],
            "model.depth=2: tools/export.py takes run_dir=, step=, ema=, format=, out=, opset=, "
            "half=, int8=, benchmark= only",
        ),
        (
            "export",
            ["/tmp/run"],
            "/tmp/run: not a key=value: tools/export.py takes run_dir=, step=, ema=, format=, "
            "out=, opset=, half=, int8=, benchmark=, e.g. run_dir=/tmp/run",
        ),
        (
            "export",
            ["run_dir=/tmp", "foo=1"],
            "foo is not a setting: tools/export.py takes run_dir=, step=, ema=, format=, out=, "
            "opset=, half=, int8=, benchmark= only",
        ),
        ("export", ["run_dir=/tmp", "opsett=18"], "did you mean opset?"),
        ("export", ["format=onnx"], "run_dir= is missing"),
        (
            "train",
            ["data=coco", "data.images=images/{split}"],
            "data.images=images/{split}: Hydra reads { } [ ] ( ) , = spaces and quotes in a value "
            "as its grammar: quote the value inside the shell's quotes, "
            "'data.images=\"images/{split}\"'",
        ),
        (
            "train",
            ['data.images="images/{split}"'],
            "data.images= is read by detection data (data=detection, data=coco); "
            "data.format=imagefolder reads class folders (<root>/<split>/<class>/): drop "
            "data.images",
        ),
        (
            "train",
            ["data.format=yolo"],
            "data.format=yolo is a format of detection data, and model=vit_tiny is a "
            "classification model: give classification data (data=imagenet for class folders, "
            "data=shapes for the built-in set; or data.format= one of imagefolder, shards), or a "
            "detection model (e.g. model=fasterrcnn_mobilenet_v3)",
        ),
        (
            "train",
            ["model=fasterrcnn_mobilenet_v3", "data.root=/tmp/my_yolo_set"],
            "data.format=imagefolder is a format of classification data, and "
            "model=fasterrcnn_mobilenet_v3 is a detection model: give detection data "
            "(data=detection for a YOLO, VOC or COCO set, data=shapes_coco for the built-in one; "
            "or data.format= one of coco, yolo, voc, auto, shards), or a classification model "
            "(e.g. model=vit_tiny)",
        ),
        (
            "train",
            ["model=fasterrcnn_mobilenet_v3", "data=shapes_coco", "data.format=yolov8"],
            "data.format=yolov8 is not a data format here: use one of coco, yolo, voc, auto, "
            "shards",
        ),
        ("eval", ["-m", "run_dir=/tmp"], "-m: tools/eval.py runs once per command"),
        # every tool reads a true/false key the same way, before it composes a config
        ("data", ["convert", "to=yolo", "out=/tmp/x", "link=yes"], "link=yes: give true or false"),
        ("data", ["pack", "out=/tmp/x", "overwrite=1"], "overwrite=1: give true or false"),
        ("export", ["run_dir=/tmp", "half=yes"], "half=yes: give true or false"),
        (
            "predict",
            ["weights=absent.safetensors", "source=a.jpg", "save_txt=yes"],
            "save_txt=yes: give true or false",
        ),
        (
            "eval",
            ["runs_dir=/tmp"],
            "runs_dir is not a setting of tools/eval.py: did you mean run_dir?",
        ),
        ("eval", ["step=2"], "step=2 picks a checkpoint of a run: add run_dir=<run>"),
        (
            "eval",
            ["run_dir=/tmp", "model=maskrcnn_mobilenet_v3"],
            "model=maskrcnn_mobilenet_v3: a run keeps its own model; change keys within it (e.g. "
            "data.root=/path), or give weights=<file> model=maskrcnn_mobilenet_v3 instead",
        ),
        ("eval", [], "give run_dir=<run dir> (a training run) or weights=<file>"),
        ("plan", ["--info"], "--info:"),
        ("benchmark", ["hydra.verbose=true"], "hydra.verbose:"),
    ],
)
def test_every_tool_refuses_in_one_line(capsys, name, argv, expected):
    code, out, err = _call(capsys, name, *argv)
    assert code == 2 and not out and len(err) == 1 and expected in err[0], (code, out, err)


def test_hydra_run_dir_is_trainer_run_dir(tmp_path):
    from visiondist.cli import Tool, load_config, parse

    cmd = parse(Tool(), CONFIGS, ["hydra.run.dir=" + str(tmp_path / "run"), "trainer.max_steps=2"])
    assert cmd.overrides == [f"trainer.run_dir={tmp_path / 'run'}", "trainer.max_steps=2"]
    assert load_config(CONFIGS, cmd.overrides, inputs=None).trainer.run_dir == str(tmp_path / "run")


def test_hydra_sweep_dir_is_the_sweeps_directory(tmp_path, capsys):
    from visiondist.cli import run_tool

    ran = []
    code = run_tool(
        "train.py",
        CONFIGS,
        ["-m", "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={tmp_path}"],
        lambda cfg: ran.append(cfg.trainer.run_dir) or 0,
    )
    assert code == 0 and ran == [str(tmp_path / "0"), str(tmp_path / "1")]
    jobs = json.loads((tmp_path / "sweep.json").read_text())["jobs"]
    assert [j["run_dir"] for j in jobs] == ran
    assert "job 0 (1 of 2)" in capsys.readouterr().out  # banners, dirs and table all count from 0


def test_cfg_job_all_resolve_and_package_print_the_composed_config(capsys):
    code, out, err = _call(
        capsys, "train", "--cfg", "job", "--resolve", "model=vit_small", "-p", "model"
    )
    assert code == 0 and not err
    assert OmegaConf.create(out).name == "vit_small"
    code, out, _ = _call(
        capsys, "train", "--cfg", "all", "-p", "model.embed_dim", "model=vit_small"
    )
    assert (code, out.strip()) == (0, "384")
    code, out, _ = _call(capsys, "train", "--cfg", "trainer.max_steps=7")  # a bare --cfg, as before
    assert code == 0 and OmegaConf.create(out).trainer.max_steps == 7
    code, out, _ = _call(capsys, "plan", "-c", "job", "-p", "trainer.devices", "trainer.devices=3")
    assert (code, out.strip()) == (0, "3")


def test_version_names_the_libraries(capsys):
    code, out, _ = _call(capsys, "export", "--version")
    assert code == 0 and all(
        name in out for name in ("visiondist", "torch", "torchvision", "hydra")
    )


def test_config_dir_adds_options(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "my_vit.yaml").write_text(
        "name: my_vit\nembed_dim: 96\ndepth: 3\nnum_heads: 3\n"
    )
    code, out, err = _call(
        capsys, "train", "-cd", str(tmp_path), "model=my_vit", "--cfg", "-p", "model"
    )
    assert code == 0 and not err, err
    model = OmegaConf.create(out)
    assert (model.name, model.depth, model.embed_dim, model.patch_size) == ("my_vit", 3, 96, 16)
    code, out, _ = _call(
        capsys,
        "train",
        "--config-dir",
        str(tmp_path),
        "-m",
        "model=my_vit,vit_tiny",
        "--cfg",
        "-p",
        "model.depth",
    )
    assert code == 0 and "# job 0: model=my_vit\n3" in out and "# job 1: model=vit_tiny\n12" in out


@pytest.fixture
def fake_run(tmp_path):
    """A run dir as far as the command line looks: config.yaml, model.safetensors, a complete step_3
    checkpoint."""
    from visiondist.cli import load_config
    from visiondist.utils.dcp import METADATA, STATE_FILE

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(CONFIGS, ["model.depth=2", f"trainer.run_dir={run}"], inputs=None)
    OmegaConf.save(cfg, run / "config.yaml", resolve=True)
    (run / "model.safetensors").write_bytes(b"")
    step = run / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / METADATA).write_bytes(b"")
    (step / STATE_FILE).write_text("{}")
    return run


@pytest.mark.parametrize(
    "old,new,weights",
    [
        ("{run}", "run_dir={run}", "{run}/model.safetensors"),
        ("{run}/checkpoints/step_3", "run_dir={run} step=3", "{run}/checkpoints/step_3"),
        ("{run}/model.safetensors", "weights={run}/model.safetensors", "{run}/model.safetensors"),
    ],
)
def test_eval_takes_its_old_positional_path_with_a_deprecation_line(
    capsys, fake_run, old, new, weights
):
    old, new, weights = (s.format(run=fake_run) for s in (old, new, weights))
    code, out, err = _call(capsys, "eval", old, "--cfg", "-p", "model.weights")
    assert code == 0 and out.strip() == weights
    assert err == [f"tools/eval.py {old}: a bare path is deprecated: write tools/eval.py {new}"]
    code, out, err = _call(capsys, "eval", *new.split(), "--cfg", "-p", "model.weights")
    assert (code, out.strip(), err) == (0, weights, [])


def test_the_end_of_a_run_prints_its_next_commands(tmp_path, monkeypatch):
    from visiondist.observe.console import next_commands

    (tmp_path / "outputs" / "r").mkdir(parents=True)
    monkeypatch.chdir(REPO)  # where the README's commands run: the tools as tools/<name>.py
    assert next_commands(tmp_path / "outputs" / "r").splitlines() == [
        f"run dir: {tmp_path}/outputs/r",
        f"  evaluate: python tools/eval.py run_dir={tmp_path}/outputs/r",
        f"  predict:  python tools/predict.py run_dir={tmp_path}/outputs/r source=<images, "
        "folder, glob, list or video>",
        f"  export:   python tools/export.py run_dir={tmp_path}/outputs/r   (safetensors; "
        "format=onnx, openvino, pt2 or hf; format=onnx half=true or int8=true: float16 or int8, "
        "the "
        "accuracy it costs printed)",
    ]
    # elsewhere: the commands still run as printed (the tools by their full path)
    monkeypatch.chdir(tmp_path)
    assert next_commands(tmp_path / "outputs" / "r").splitlines() == [
        "run dir: outputs/r",
        f"  evaluate: python {REPO}/tools/eval.py run_dir=outputs/r",
        f"  predict:  python {REPO}/tools/predict.py run_dir=outputs/r source=<images, folder, "
        "glob, list or video>",
        f"  export:   python {REPO}/tools/export.py run_dir=outputs/r   (safetensors; format=onnx, "
        "openvino, pt2 or hf; format=onnx half=true or int8=true: float16 or int8, the accuracy "
        "it costs printed)",
    ]
    # ranks torchrun started: training on is its command again, with the run dir whole
    longer = next_commands(tmp_path / "outputs" / "r", longer="trainer.max_steps=20")
    assert longer.splitlines()[1] == (
        f"  train on: python {REPO}/tools/train.py trainer.run_dir=outputs/r trainer.max_steps=20"
        "   (from its newest checkpoint, its config as it was)"
    )
    torchrun = next_commands(
        tmp_path / "outputs" / "r", longer="trainer.max_steps=20", under_torchrun=True
    )
    assert torchrun.splitlines()[1] == (
        "  train on: the same torchrun / srun / pod command with "
        f"trainer.run_dir={tmp_path}/outputs/r trainer.max_steps=20   (from its newest "
        "checkpoint, its config as it was)"
    )
    # a run started from Python: the methods of the Run visiondist.train returned
    from visiondist.observe.console import continue_command, said_to_python

    with said_to_python():
        python = next_commands(
            tmp_path / "outputs" / "r", longer="trainer.max_steps=20", images=tmp_path / "val"
        )
        resumed = continue_command(tmp_path / "outputs" / "r")
    assert python.splitlines() == [
        "run dir: outputs/r   (the Run visiondist.train returned; later: run = "
        f"visiondist.Run('{tmp_path}/outputs/r'))",
        "  train on: run.resume('trainer.max_steps=20')   (from its newest checkpoint)",
        "  evaluate: run.evaluate()",
        "  predict:  run.predict('val')   (a Result per image)",
        '  export:   run.export()   (safetensors; "onnx", "openvino", "pt2" or "hf"; "onnx", '
        "half=True or int8=True: float16 or int8, the accuracy it costs printed)",
    ]
    assert resumed == f"visiondist.Run('{tmp_path}/outputs/r').resume()"
    assert "run.evaluate()" not in next_commands(tmp_path / "outputs" / "r")  # the tools again


def test_imagenet_data_takes_its_class_count_from_the_class_folders(capsys, tiny_shapes):
    from visiondist.cli import load_config

    cfg = load_config(CONFIGS, ["data=imagenet", f"data.root={tiny_shapes}", "data.batch_size=16"])
    assert cfg.data.num_classes == cfg.model.num_classes == 6
    out = capsys.readouterr().out
    assert (
        f"data.num_classes=6: inferred from the 6 class folders of {tiny_shapes / 'train'}" in out
    )
    cfg = load_config(
        CONFIGS,
        ["data=imagenet", f"data.root={tiny_shapes}", "data.num_classes=6", "data.batch_size=16"],
    )
    # a set value is only checked
    assert cfg.model.num_classes == 6 and "inferred" not in capsys.readouterr().out


def test_a_class_count_with_nothing_to_count(capsys, tmp_path):
    from visiondist.cli import load_config
    from visiondist.preflight import infer_num_classes

    # printing: stays unset
    cfg = load_config(CONFIGS, ["data=imagenet", "data.root=/nonexistent"], inputs=None)
    assert OmegaConf.is_missing(cfg.data, "num_classes")
    code, out, err = _call(
        capsys, "plan", "data=imagenet", "trainer.devices=2", "parallel.device_memory_gb=80"
    )
    assert code == 0 and any("planned with 1000 classes" in line for line in err), err
    for c in range(3):  # evaluation needs only the val split: its folders count then
        (tmp_path / "val" / f"n{c}").mkdir(parents=True)
    cfg = load_config(CONFIGS, ["data=imagenet", f"data.root={tmp_path}"], inputs=None)
    note = infer_num_classes(cfg, "eval")
    assert note == f"data.num_classes=3: inferred from the 3 class folders of {tmp_path / 'val'}"
    assert cfg.model.num_classes == 3


def test_eval_and_benchmark_dirs_are_named_as_what_they_are(tmp_path):
    from visiondist.bench.harness import run_benchmark
    from visiondist.engine.run import evaluate_checkpoint, train
    from visiondist.launch import default_run_dir, run_kind

    cfg = OmegaConf.create({"trainer": {"output_dir": str(tmp_path)}})
    assert (run_kind(train), run_kind(evaluate_checkpoint), run_kind(run_benchmark)) == (
        None,
        "eval",
        "benchmark",
    )
    for kind in ("eval", "benchmark"):
        path = default_run_dir(cfg, kind)
        assert path.parent == tmp_path / kind and len(path.name.split("_")) == 2, path
    trained = default_run_dir(cfg)
    assert trained.parent.parent == tmp_path and trained.parent.name.count("-") == 2


def test_own_data_under_the_built_in_sets_config_is_refused_naming_its_data_group(capsys, tmp_path):
    """data.root pointed at one's own folder with the default data=shapes (data= forgotten): one
    line naming the group that reads it (class folders: data=imagenet; a YOLO set: data=detection),
    before a rank starts; the folder is left as it was."""
    from visiondist.cli import run_tool

    classes = tmp_path / "pets"
    for split in ("train", "val"):
        (classes / split / "cat").mkdir(parents=True)
        (classes / split / "cat" / "a.jpg").write_bytes(b"x")
    yolo = tmp_path / "boxes"
    (yolo / "images" / "train").mkdir(parents=True)
    (yolo / "data.yaml").write_text("path: .\ntrain: images/train\nval: images/train\nnames: [a]\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    said = {}
    for root in (classes, yolo, other):
        ran = []
        code = run_tool(
            _tool("train").TOOL,
            CONFIGS,
            [f"data.root={root}", f"trainer.run_dir={tmp_path / 'run'}"],
            ran.append,
        )
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2 and not ran and not (tmp_path / "run").exists() and len(err) == 1, err
        said[root.name] = err[0]
    assert said["pets"].endswith(
        f"{classes} is not the built-in shapes set: it holds class folders (train/<class>/): "
        f"read it with data=imagenet data.root={classes}"
    ), said
    assert said["boxes"].endswith(
        f"{yolo} is not the built-in shapes set: it holds a YOLO set (data.yaml): read it with "
        f"data=detection data.root={yolo}"
    ), said
    assert said["other"].endswith(
        "for your own data add data=imagenet (class folders: train/<class>/, val/<class>/) or "
        "data=detection (a YOLO, Pascal VOC or COCO set), or point data.root elsewhere"
    ), said
    assert sorted(p.name for p in classes.rglob("*")) == [
        "a.jpg",
        "a.jpg",
        "cat",
        "cat",
        "train",
        "val",
    ]


def test_a_built_in_set_made_with_other_settings_is_refused_before_any_rank(capsys, tmp_path):
    """data.root holding the built-in set generated with other data.synthetic settings: train.py and
    `data.py pack` stop with one line naming the fix, before a rank starts or a run dir is made (it
    was a rank's failure)."""
    from visiondist.cli import load_config, run_tool
    from visiondist.synthetic import prepare_data

    root = tmp_path / "shapes_coco"
    small = [
        "model=fasterrcnn_mobilenet_v3",
        "data=shapes_coco",
        f"data.root={root}",
        "data.synthetic.train_images=8",
        "data.synthetic.val_images=4",
        "data.synthetic.image_size=32",
    ]
    prepare_data(load_config(CONFIGS, small, inputs=None).data)
    other = [
        *small[:3],
        "data.synthetic.train_images=9",
        "data.synthetic.val_images=4",
        "data.synthetic.image_size=32",
    ]
    ran = []
    code = run_tool(
        _tool("train").TOOL, CONFIGS, [*other, f"trainer.run_dir={tmp_path / 'run'}"], ran.append
    )
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and not ran and not (tmp_path / "run").exists(), err
    assert len(err) == 1 and err[0].endswith(
        f"{root} holds the shapes_coco dataset generated with other settings: add "
        "data.synthetic.train_images=8 to read it as it is, or point data.root elsewhere (or "
        "delete that folder) to generate the requested one"
    ), err
    code, out, err = _call(capsys, "data", "pack", *other, f"out={tmp_path / 'packed'}")
    assert code == 2 and len(err) == 1 and "add data.synthetic.train_images=8" in err[0], (
        code,
        out,
        err,
    )
    assert (
        not (tmp_path / "packed").exists()
        and json.loads((root / "dataset.json").read_text())["train_images"] == 8
    )


@pytest.mark.parametrize(
    "trained_splits, overrides, warned",
    [
        (("train", "val"), ["data.val_split=train"], True),
        (("train", "train"), [], True),
        (("train", "val"), [], False),
        (("train", "val"), ["data.val_split=train", "data.root=/elsewhere"], False),
    ],
)
def test_eval_on_the_split_a_run_trained_on_is_warned_of(
    tmp_path, caplog, trained_splits, overrides, warned
):
    """Scoring the images a run trained on measures fit, not generalisation: eval.py says so."""
    from visiondist.api.jobs import _warn_if_trained_on
    from visiondist.config.compose import compose

    train, val = trained_splits
    trained = [f"data.root={tmp_path}/own", f"data.train_split={train}", f"data.val_split={val}"]
    OmegaConf.save(compose(REPO / "configs", trained), tmp_path / "config.yaml")
    cfg = compose(REPO / "configs", trained + overrides)
    with caplog.at_level("WARNING"):
        _warn_if_trained_on(tmp_path, cfg)
    said = [r.getMessage() for r in caplog.records if "trained on" in r.getMessage()]
    assert bool(said) is warned, said
    if warned:
        assert said == [
            f"data.val_split=train is the split {tmp_path} trained on: these scores measure how "
            "well the model fits its training images, not how it does on new ones"
        ]


def test_the_commands_that_go_on_with_a_run_repeat_its_last_attempts_changes(tmp_path):
    """A run started under tp2 and continued under pp2 with gpipe: the printed train-on and continue
    commands carry the pp2 attempt's changes, and continuing with them runs the attempt's layout,
    not config.yaml's tp2."""
    import shlex

    from visiondist.config.compose import compose
    from visiondist.observe.console import continue_command, next_commands
    from visiondist.runs import continue_config, record_attempt

    first = ["parallel=tp2", "trainer.max_steps=20", f"trainer.run_dir={tmp_path}"]
    saved = compose(REPO / "configs", first)
    OmegaConf.save(saved, tmp_path / "config.yaml")
    asked = [f"trainer.run_dir={tmp_path}", "parallel=pp2", "parallel.schedule=gpipe"]
    attempt = continue_config(
        compose(REPO / "configs", asked + ["trainer.max_steps=30"]),
        saved,
        asked + ["trainer.max_steps=30"],
    )
    record_attempt(tmp_path, saved, attempt)
    repeated = (
        "parallel.microbatches=4 parallel.name=pp2 parallel.pp=2 parallel.schedule=gpipe "
        "parallel.tp=1"
    )
    (line,) = [
        line
        for line in next_commands(tmp_path, longer="trainer.max_steps=60").splitlines()
        if "train on:" in line
    ]
    assert line.endswith(
        f"trainer.run_dir={tmp_path} {repeated} trainer.max_steps=60   (from its newest "
        "checkpoint, as its last attempt ran)"
    ), line
    command = continue_command(tmp_path)
    assert command.endswith(f"trainer.run_dir={tmp_path} {repeated} trainer.max_steps=30")
    overrides = shlex.split(command)[2:]
    again = continue_config(compose(REPO / "configs", overrides), saved, overrides)
    assert again.parallel == attempt.parallel and again.trainer.max_steps == 30
    assert saved.parallel.tp == 2 and again.parallel.tp == 1
    # from Python: the same changes, as the Run's resume arguments
    from visiondist.observe.console import said_to_python

    with said_to_python():
        resumed = continue_command(tmp_path)
        (line,) = [
            line
            for line in next_commands(tmp_path, longer="trainer.max_steps=60").splitlines()
            if "train on:" in line
        ]
    words = ", ".join(repr(w) for w in repeated.split())
    assert resumed == f"visiondist.Run({str(tmp_path)!r}).resume({words}, 'trainer.max_steps=30')"
    assert (
        line
        == f"  train on: run.resume({words}, 'trainer.max_steps=60')   (from its newest checkpoint)"
    )
