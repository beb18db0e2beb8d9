"""visiondist from Python on 2 ranks: `train` returns the run its tool would have written, the
user's callbacks run on every rank and come back, a callback on one rank stops every rank at the
same step with a checkpoint that `resume` continues, and a run's evaluate, predict and export give
what the tools give."""

import json
import os
import sys

import numpy as np
import pytest
from helpers import TINY_DATA, call_tool
from PIL import Image

import visiondist
from visiondist.inference import predict as predict_records
from visiondist.launch.spawn import RANKS_ENVIRONMENT


class Counting:
    """Counts its calls on its rank; asks the run to stop after `stop_at` on rank `stop_rank`."""

    def __init__(self, stop_at=None, stop_rank=1):
        self.calls = {"start": 0, "step": 0, "eval": 0, "end": 0}
        self.stop_at, self.stop_rank = stop_at, stop_rank
        self.steps, self.ended_at, self.rank, self.world, self.metrics = [], None, None, None, {}

    def on_train_start(self, state):
        self.calls["start"] += 1
        self.rank, self.world = state.rank, state.world_size

    def on_step_end(self, state):
        self.calls["step"] += 1
        self.steps.append(state.step)
        if state.step == self.stop_at and state.rank == self.stop_rank:
            state.stop("enough for this test")

    def on_eval_end(self, state):
        self.calls["eval"] += 1
        self.metrics = state.metrics

    def on_train_end(self, state):
        self.calls["end"] += 1
        self.ended_at = (state.step, state.complete)


def _settings(tmp_path, tiny_shapes, steps):
    return dict(
        data={"root": str(tiny_shapes), "batch_size": 16},
        trainer={
            "max_steps": steps,
            "max_epochs": 0,
            "eval_every": 2,
            "devices": 2,
            "accelerator": "cpu",
            "loggers": ["csv"],
            "output_dir": str(tmp_path / "outputs"),
        },
    )


def _overrides():
    # TINY_DATA holds data.* / model.* / trainer.* settings as the tools take them
    return [o for o in TINY_DATA if not o.startswith("data.root")]


def test_train_on_two_ranks_with_callbacks_then_stop_and_resume(tmp_path, tiny_shapes, capsys):
    environment = {name: os.environ.get(name) for name in RANKS_ENVIRONMENT}
    run = visiondist.train(
        "model=vit_tiny",
        *_overrides(),
        callbacks=[Counting(stop_at=2)],
        **_settings(tmp_path, tiny_shapes, 6),
    )
    said = capsys.readouterr().out
    # the ranks' threads and OpenMP waiting were theirs: a later run of one rank in this process
    # gets this process's own (OMP_NUM_THREADS=1 for two ranks on 2 cores stayed set before)
    assert {name: os.environ.get(name) for name in RANKS_ENVIRONMENT} == environment
    # the callback on rank 1 asked after step 2; every rank stopped at the same step: the request
    # travels with the step flags, which are read a step late (no host wait in the loop)
    ended = {rank: cbs[0].ended_at for rank, cbs in run.callbacks.items()}
    assert list(ended) == [0, 1]  # by rank
    (stop_step, complete), *_ = ended.values()
    assert set(ended.values()) == {(stop_step, False)} and stop_step in (3, 4)
    # said as this session continues it: the Run's resume, not the tool's command line
    assert (
        "(Counting asked to stop: enough for this test); continue with: "
        f"visiondist.Run({str(run.dir)!r}).resume()"
    ) in said, said[-2000:]
    assert not run.complete and run.checkpoints[-1].name == f"step_{stop_step}"
    for rank, (counter,) in run.callbacks.items():
        assert counter.rank == rank and counter.world == 2
        assert counter.calls["start"] == 1 and counter.calls["end"] == 1
        # on_step_end for every step, the one the stop ended the loop after included
        assert counter.steps == list(range(1, stop_step + 1))

    again = run.resume(callbacks=[Counting()])
    assert again.dir == run.dir and again.complete
    for (counter,) in again.callbacks.values():
        assert counter.steps == list(range(stop_step + 1, 7)) and counter.ended_at == (6, True)
        # every evaluation the run made after it resumed (steps 4 and 6), the last one's figures
        assert counter.calls["eval"] == 2
        assert counter.metrics["step"] == 6
        assert counter.metrics["val_top1"] == pytest.approx(again.metrics["val_top1"])
    assert again.summary["steps"] == 6 and again.weights is not None
    assert again.layout["world_size"] == 2
    assert [r["step"] for r in again.rows if r["loss"] is not None][-1] == 6
    # one row a step, an evaluation joined to its step's (the epoch's end included: both rows
    # count the step's epoch)
    steps = [r["step"] for r in again.rows]
    assert steps == sorted(set(steps)), again.rows
    assert again.rows[-1]["loss"] is not None and again.rows[-1]["val_top1"] is not None


def test_a_runs_evaluate_predict_and_export_are_the_tools(tmp_path, tiny_shapes, capsys):
    settings = _settings(tmp_path, tiny_shapes, 2)
    settings["trainer"]["devices"] = 1
    hook = sys.excepthook
    run = visiondist.train("model=vit_tiny", *_overrides(), **settings)
    assert run.complete and run.callbacks == {}
    # the process group torch formed in this process leaves no "[rank0]: " prefix on its errors
    assert sys.excepthook is hook

    metrics = run.evaluate()
    assert metrics["step"] == run.step == run.metrics["step"]  # the weights' training step
    written = json.loads(next((run.dir / "eval").glob("*/eval.json")).read_text())
    assert metrics["val_top1"] == pytest.approx(written["val_top1"])
    assert metrics["val_top1"] == pytest.approx(run.metrics["val_top1"])

    results = list(visiondist.predict(tiny_shapes / "val", run=run, topk=2))
    records = list(predict_records(str(tiny_shapes / "val"), run_dir=str(run.dir), topk=2))
    assert [r.record for r in results] == records
    assert results[0].plot().ndim == 3 and results[0]._repr_png_()[:4] == b"\x89PNG"
    assert results[0].save(tmp_path / "drawn.jpg").read_bytes()[:2] == b"\xff\xd8"  # JPEG
    # the format the name asks for: a PNG is lossless, the drawn pixels exactly
    assert np.array_equal(
        np.asarray(Image.open(results[0].save(tmp_path / "drawn.png"))), results[0].plot()
    )
    with pytest.raises(ValueError, match=r"drawn.gif: a drawn image is written as one of .jpg"):
        results[0].save(tmp_path / "drawn.gif")

    # save=: tools/predict.py's job and files
    folder = run.predict(tiny_shapes / "val", topk=2, save=tmp_path / "api", save_images=2)
    code, _, _ = call_tool(
        capsys,
        "predict",
        f"run_dir={run.dir}",
        f"source={tiny_shapes / 'val'}",
        f"out={tmp_path / 'tool'}",
        "topk=2",
        "save_images=2",
    )
    assert code == 0 and folder == tmp_path / "api"
    for name in ("predictions.csv", "images"):
        assert (folder / name).exists()
    assert (folder / "predictions.csv").read_text() == (
        tmp_path / "tool" / "predictions.csv"
    ).read_text()
    assert sorted(p.name for p in (folder / "images").iterdir()) == sorted(
        p.name for p in (tmp_path / "tool" / "images").iterdir()
    )
    with pytest.raises(visiondist.ConfigError, match="save= writes a prediction of files"):
        run.predict([results[0].image()], save=True)
    # a list with a file that is not there: that file's Result says so, the others predict
    first = sorted((tiny_shapes / "val").rglob("*.jpg"))[0]
    found, missing = run.predict([first, tmp_path / "missing.jpg"], topk=2)
    (alone,) = run.predict([first], topk=2)
    assert found.top == alone.top and found.width == 32
    # the run's own weights file predicts under the run's config (its size, normalisation, classes:
    # the file records only the names); a model setting that does not fit it is one line
    (own,) = visiondist.predict([first], weights=run.dir / "model.safetensors", topk=2)
    assert own.top == alone.top
    with pytest.raises(
        visiondist.ConfigError, match=r"is a ViT \(width 192, depth 2.*: use model.depth=2"
    ):
        visiondist.predict(first, "model=vit_tiny", weights=run.dir / "model.safetensors")
    assert missing.error == "no such file" and missing.width is None and missing.top is None

    onnx = run.export("onnx")
    assert onnx == run.dir / "export" / "model.onnx" and onnx.stat().st_size > 0
    # the exported file predicts as the run: the model named as a keyword, as train takes it, and
    # no class count (data=imagenet's is the data's, which prediction does not read: the file's
    # recorded names give it)
    model = dict(o.split("=", 1) for o in _overrides() if o.startswith("model."))
    from_file = visiondist.predict(
        tiny_shapes / "val",
        "data=imagenet",
        *(f"{k}={v}" for k, v in model.items()),
        weights=onnx,
        model="vit_tiny",
        data={"img_size": 32},
        topk=2,
    )
    probs = lambda rs: [(r.file, {t["name"]: t["prob"] for t in r.top}) for r in rs]  # noqa: E731
    got, want = probs(from_file), probs(results)
    assert [f for f, _ in got] == [f for f, _ in want]
    for (_, a), (_, b) in zip(got, want):
        shared = set(a) & set(b)  # two nearly tied classes may swap in the top 2
        assert shared and all(a[n] == pytest.approx(b[n], abs=1e-4) for n in shared), (a, b)
    # and scored by the evaluation under data=imagenet's settings: the file's recorded
    # preprocessing gives the run's top-1
    scored = visiondist.evaluate(
        "model=vit_tiny",
        "data=imagenet",
        *(f"{k}={v}" for k, v in model.items()),
        f"data.root={tiny_shapes}",
        "data.img_size=32",
        "data.num_classes=6",
        weights=onnx,
        trainer={"devices": 1, "accelerator": "cpu", "output_dir": str(tmp_path / "outputs")},
    )
    assert scored["val_top1"] == pytest.approx(metrics["val_top1"], abs=1e-6)
    with pytest.raises(visiondist.ConfigError, match="format=zip: choose one of"):
        run.export("zip")


def test_benchmark_returns_the_rows_the_tool_records(tmp_path, tiny_shapes):
    results = tmp_path / "results"
    rows = visiondist.benchmark(
        "model=vit_tiny",
        *_overrides(),
        data={"root": str(tiny_shapes), "batch_size": 8},
        trainer={"accelerator": "cpu", "loggers": ["csv"], "output_dir": str(tmp_path / "runs")},
        bench={
            "warmup": 1,
            "steps": 2,
            "rounds": 2,
            "loader_batches": 2,
            "results_dir": str(results),
        },
    )
    recorded = [json.loads(line) for line in (results / "results.jsonl").read_text().splitlines()]
    assert len(rows) == len(recorded) == 1
    assert recorded[0]["model"] == "vit_tiny"
    assert json.loads(json.dumps(rows[0])) == recorded[0]  # the row the tool appends
