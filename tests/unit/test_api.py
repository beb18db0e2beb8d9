"""The Python API's edge (visiondist.api): keywords become the tools' overrides, a refusal is one
ConfigError line raised before anything runs, callbacks are checked before any rank starts, and
images in memory become a prediction's source."""

import threading

import numpy as np
import pytest
import torch
from PIL import Image

import visiondist
from visiondist.api.callbacks import pack
from visiondist.api.jobs import as_overrides
from visiondist.api.predicting import as_source
from visiondist.inference.sources import Source


def test_nested_keywords_are_the_tools_overrides():
    assert as_overrides(
        ["model=vit_tiny"],
        {
            "trainer": {"max_steps": 10, "compile": False, "loggers": ["csv"]},
            "parallel": "tp2",
            "data.root": "/data/my set",
            "optim": {"lr": 1e-3},
            "model.weights": None,
        },
    ) == [
        "model=vit_tiny",
        "trainer.max_steps=10",
        "trainer.compile=false",
        "trainer.loggers=[csv]",
        "parallel=tp2",
        "data.root='/data/my set'",
        "optim.lr=0.001",
        "model.weights=null",
    ]
    with pytest.raises(visiondist.ConfigError, match="as the tools take them"):
        as_overrides(["vit_tiny"], {})


def test_a_misspelt_option_is_one_line_with_the_closest():
    with pytest.raises(visiondist.ConfigError) as caught:
        visiondist.train("model=vit_tinny")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "model=vit_tinny is not an option of model: did you mean model=vit_tiny?"
    )
    # raised at the API's edge, not from inside Hydra
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_a_path_given_as_a_group_option_names_the_key_that_takes_it():
    with pytest.raises(visiondist.ConfigError, match=r"a path goes in data=detection data.root="):
        visiondist.train("data=/data/set/data.yaml")


class _Counter:
    def on_step_end(self, state):
        pass


class _Holding(_Counter):
    def __init__(self):
        self.lock = threading.Lock()


def test_callbacks_are_checked_before_any_rank():
    assert pack([]) is None
    assert pack([_Counter()])  # serialised
    with pytest.raises(visiondist.ConfigError, match=r"callbacks\[0\] \(_Counter\) is a class"):
        pack([_Counter])
    with pytest.raises(visiondist.ConfigError, match=r"callbacks\[1\] \(object\) has none of"):
        pack([_Counter(), object()])
    with pytest.raises(
        visiondist.ConfigError, match=r"callbacks\[0\] \(_Holding\) cannot reach the ranks"
    ):
        pack([_Holding()])


def test_images_in_memory_become_a_source(tmp_path):
    photo = tmp_path / "a.png"
    rgb = np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(photo)
    assert as_source(str(photo)) == str(photo)  # a path: tools/predict.py's source=
    source = as_source([rgb, Image.fromarray(rgb), torch.from_numpy(rgb).permute(2, 0, 1), photo])
    assert isinstance(source, Source) and len(source) == 4
    assert source.name(0) == "image0" and source.name(3) == str(photo)
    for i in range(4):
        assert np.array_equal(source.image(i), rgb)
    floats = torch.from_numpy(rgb).permute(2, 0, 1).float() / 255
    assert np.array_equal(as_source(floats[None].repeat(2, 1, 1, 1)).image(1), rgb)
    grey = as_source(rgb[..., 0]).image(0)
    assert grey.shape == (20, 30, 3) and np.array_equal(grey[..., 2], rgb[..., 0])
    with pytest.raises(visiondist.ConfigError, match=r"source\[1\]: int is not an image"):
        as_source([rgb, 3])
    with pytest.raises(visiondist.ConfigError, match=r"shape \(2, 2, 7\) is not an image"):
        as_source(np.zeros((2, 2, 7)))
    # a file that is not there: its Result says so (`visiondist.inference.run`), the others predict
    with pytest.raises(FileNotFoundError):
        as_source([photo, tmp_path / "missing.jpg"]).image(1)


def test_a_run_is_its_directory(tmp_path):
    with pytest.raises(visiondist.ConfigError, match="not a run dir"):
        visiondist.Run(tmp_path)
    with pytest.raises(visiondist.ConfigError, match="no such folder"):
        visiondist.Run(tmp_path / "missing")
    with pytest.raises(visiondist.ConfigError, match=r"Run\(None\): give a training run's dir"):
        visiondist.Run(None)


def test_a_runs_rows_are_one_per_step_with_its_evaluation(tmp_path):
    """metrics.csv writes an evaluation on a row of its own beside its step's training row:
    `run.rows` joins them (one row a step, for a DataFrame), `metrics` is the latest evaluation."""
    (tmp_path / "config.yaml").write_text("model: {}\n")
    (tmp_path / "metrics.csv").write_text(
        "step,epoch,loss,lr,val_loss,val_top1\n"
        "10,1,2.0,0.001,,\n"
        "20,1,1.5,0.001,,\n"
        "20,1,,,1.4,40.0\n"
        "30,2,1.2,0.0005,,\n"
    )
    run = visiondist.Run(tmp_path)
    assert [(r["step"], r["loss"], r["val_top1"]) for r in run.rows] == [
        (10, 2.0, None),
        (20, 1.5, 40.0),
        (30, 1.2, None),
    ]
    assert run.metrics == {"val_loss": 1.4, "val_top1": 40.0, "step": 20} and run.step == 30


def test_a_misspelt_group_is_one_line_with_the_closest():
    with pytest.raises(
        visiondist.ConfigError, match="traner is not a setting: did you mean trainer?"
    ):
        visiondist.train(traner={"max_steps": 5})


def test_images_in_memory_come_back_writable():
    """np.asarray of a PIL image is read-only, which torch warns about when it wraps it."""
    image = np.asarray(Image.new("RGB", (4, 3)))
    assert not image.flags.writeable
    assert as_source(image).image(0).flags.writeable


def test_a_pil_image_in_memory_is_read_upright_as_its_file(tmp_path):
    """A photo whose EXIF says "rotate 90" (orientation 6), given as Image.open(path): the same
    upright pixels as the path reads (the loader's decoder), not the sensor's sideways ones."""
    from visiondist.data.decode import read_rgb

    pixels = np.random.default_rng(0).integers(0, 256, (40, 64, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.jpg"
    Image.fromarray(pixels).save(path, exif=exif, quality=95)
    by_path = read_rgb(path)
    assert by_path.shape == (64, 40, 3)
    with Image.open(path) as image:
        assert np.array_equal(as_source(image).image(0), by_path)


def test_a_misspelt_prediction_setting_names_the_closest():
    with pytest.raises(
        visiondist.ConfigError,
        match=r"^top_k= is not a setting of predict: did you mean topk=\? it takes topk, ",
    ):
        visiondist.predict(np.zeros((8, 8, 3), np.uint8), weights="absent.safetensors", top_k=2)


@pytest.mark.parametrize(
    "setting,says",
    [
        ({"topk": 0}, "topk=0: give a whole number, 1 or more"),
        ({"max_det": 2.5}, "max_det=2.5: give a whole number, 1 or more"),
        ({"vid_stride": 0}, "vid_stride=0: give a whole number, 1 or more"),
        ({"batch_size": -1}, r"batch_size=-1: give a whole number, 0 or more \(0: data"),
        ({"score_thresh": 1.5}, r"score_thresh=1.5: give a score in \[0, 1\]"),
    ],
)
def test_a_predictions_settings_are_checked_alike_in_python_and_the_tool(setting, says):
    """predict()'s keywords and tools/predict.py's predict.* keys go through one check: the same
    line names the value out of range, before any weights are read."""
    from omegaconf import OmegaConf

    from visiondist.api.predict_job import check_settings

    with pytest.raises(visiondist.ConfigError, match=says):
        visiondist.predict(np.zeros((8, 8, 3), np.uint8), weights="absent.safetensors", **setting)
    config = OmegaConf.create(setting)  # a config's predict group (the tool's types aside)
    with pytest.raises(visiondist.ConfigError, match=says):
        check_settings(config)


def test_a_run_reads_its_step_and_latest_evaluation_from_metrics_csv(tmp_path, monkeypatch):
    """The step metrics.csv logged last and the latest evaluation's figures, as the properties and
    repr() give them; repr() reads metrics.csv once."""
    from visiondist.api import run as run_module

    (tmp_path / "config.yaml").write_text("model: {}\n")
    (tmp_path / "metrics.csv").write_text(
        "step,train_loss,val_top1\n10,1.5,\n20,1.2,0.5\n30,1.0,\n"
    )
    run = visiondist.Run(tmp_path)
    assert run.step == 30 and run.metrics == {"val_top1": 0.5, "step": 20}
    reads = []
    real = run_module.read_metrics
    monkeypatch.setattr(run_module, "read_metrics", lambda p: reads.append(p) or real(p))
    assert repr(run) == f"Run('{tmp_path.resolve()}', stopped at step 30, val_top1=0.5)"
    assert len(reads) == 1


def test_a_callbacks_functions_keep_their_file_on_the_ranks(monkeypatch):
    """A callback defined where no rank can import it (a notebook, a script's __main__; here a
    function's local class) travels by value, and cloudpickle leaves its functions' file out: the
    ranks' copy gets it back, so that a failure's traceback names the file and line."""
    import traceback
    import weakref

    import cloudpickle

    from visiondist.api.callbacks import _unpacked, pack

    class Local:
        def on_step_end(self, state):
            def inner():
                raise ValueError(f"bad step {state}")

            inner()

        @staticmethod
        def on_train_end(state):
            return state

    callback = Local()
    callback.on_eval_end = lambda state: state
    packed = pack([callback])
    # as in a rank's process, which has never seen the class (this one would reuse it)
    monkeypatch.setattr(
        cloudpickle.cloudpickle, "_DYNAMIC_CLASS_TRACKER_BY_ID", weakref.WeakValueDictionary()
    )
    assert cloudpickle.loads(packed)[0][0].on_step_end.__code__.co_filename == "<dynamic-code>"
    (copy,) = _unpacked(packed)
    assert copy is not callback and type(copy) is not Local  # a copy made by value
    for name in ("on_step_end", "on_train_end", "on_eval_end"):
        assert getattr(copy, name).__code__.co_filename == __file__, name
    with pytest.raises(ValueError) as caught:
        copy.on_step_end(3)
    frames = traceback.extract_tb(caught.value.__traceback__)[-2:]
    assert [(f.filename, f.name) for f in frames] == [
        (__file__, "on_step_end"),
        (__file__, "inner"),
    ]
    assert frames[-1].line == 'raise ValueError(f"bad step {state}")'


def test_the_package_lists_its_functions_before_they_are_imported():
    """A notebook's completion reads dir(): the lazily imported names are there from the start."""
    assert {"train", "evaluate", "predict", "export", "Run", "ConfigError"} <= set(dir(visiondist))


def test_a_misspelt_class_to_keep_names_the_one_meant():
    from visiondist.inference.names import Names, kept_labels

    names = Names(["red_square", "green_circle", "blue_triangle"], None, "x")
    assert kept_labels(["green_circle"], names) == [2]
    with pytest.raises(
        visiondist.ConfigError, match="classes=red_sqaure: did you mean classes=red_square"
    ):
        kept_labels(["red_sqaure"], names)
