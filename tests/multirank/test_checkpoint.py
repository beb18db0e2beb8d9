"""Checkpoints through `python tools/train.py`: an interrupted and resumed run equals an uninterrupted one bit for bit;
a checkpoint saved under one layout resumes under another; a killed writer never leaves a broken checkpoint behind;
loading never runs pickled code."""

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file

from visiondist.engine.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    read_trainer_state,
)
from helpers import REPO, losses_of, run_cli, train_args, train_ok


_args, _train, _losses = train_args, train_ok, losses_of


def test_resume_mid_epoch_is_bitwise_exact(tmp_path, tiny_shapes):
    """dp=2 with drop-path (so the RNG states matter): 8 steps straight vs 4, stop, resume=auto, 4 more. The tiny
    set has 6 steps per epoch: the stop is mid-epoch and the resumed run crosses an epoch boundary."""
    common = ["model.num_heads=2", "parallel.dp=2", "model.drop_path_rate=0.2", "trainer.max_steps=8",
              "trainer.checkpoint_every=2", "trainer.keep_last=2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    _train(*_args(tiny_shapes, straight, *common))
    out = _train(*_args(tiny_shapes, split, *common, "trainer.stop_at_step=4"))
    assert "stopped after step 4 of 8" in out
    assert [step for step, _ in list_checkpoints(split)] == [2, 4]
    assert not (split / "model.safetensors").exists()
    assert read_trainer_state(latest_checkpoint(split))["epoch"] == 0

    out = _train(*_args(tiny_shapes, split, *common))  # resume=auto is the default
    assert "resumed from" in out and "step_4: step 4, epoch 0 + 4 steps" in out
    a, b = _losses(straight), _losses(split)
    assert sorted(b) == list(range(1, 9))  # rows of the first process kept, none duplicated
    assert [a[s] for s in range(5, 9)] == [b[s] for s in range(5, 9)]  # exact float equality
    assert len({a[s] for s in range(1, 9)}) == 8
    wa, wb = load_file(straight / "model.safetensors"), load_file(split / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [step for step, _ in list_checkpoints(straight)] == [6, 8]  # keep_last=2
    assert (split / "config.yaml").is_file() and len((split / "attempts.jsonl").read_text().splitlines()) == 1


RESHARD = ["model.num_heads=4", "trainer.max_steps=3"]  # 4 heads: tp2 and tp4 both divide them


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, tiny_shapes):
    run = tmp_path_factory.mktemp("reshard") / "dp1"
    _train(*_args(tiny_shapes, run, *RESHARD))
    return _losses(run)


@pytest.mark.parametrize("saved_under", [pytest.param("parallel=tp2", marks=pytest.mark.smoke), "parallel=dp2_tp2"])
def test_checkpoint_reshards_to_other_layouts(tmp_path, tiny_shapes, reference_losses, saved_under):
    """Save at step 2 under TP, resume under dp=1 and tp=4: step 3's loss is the uninterrupted run's."""
    saved = tmp_path / "saved"
    _train(*_args(tiny_shapes, saved, *RESHARD, saved_under, "trainer.stop_at_step=2"))
    state = read_trainer_state(latest_checkpoint(saved))
    assert state["step"] == 2 and state["layout"]["tp"] == 2
    for layout in ("parallel.dp=1", "parallel=tp4"):
        run = tmp_path / layout.replace("=", "_")
        out = _train(*_args(tiny_shapes, run, *RESHARD, layout, f"trainer.resume={latest_checkpoint(saved)}"))
        assert "random states restart from the seed" in out  # another layout: RNG streams cannot carry over
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
    from visiondist.engine.export import load_trained

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

    from visiondist.engine.export import load_trained

    out = tmp_path / "vit.safetensors"
    _export(tp2_run, f"out={out}")
    info = json.loads(out.with_suffix(".json").read_text())
    assert info["library"] == "timm" and info["classes"] and len(info["classes"]) == info["num_classes"]
    model = timm.create_model(**info["create"], pretrained=False).eval()
    model.load_state_dict(load_file(out), strict=True)

    trained = load_trained(tp2_run)  # the tp2 checkpoint's shards, read into one process
    gathered = load_file(tp2_run / "model.safetensors")  # what the tp2 run itself gathered at the end
    assert all(torch.equal(v, gathered[k]) for k, v in trained.model.state_dict().items())
    x = torch.randn(4, 3, info["input_size"], info["input_size"])
    with torch.no_grad():
        assert torch.allclose(model(x), trained.model(x), atol=1e-5, rtol=0)


@pytest.mark.smoke
def test_export_onnx_and_torchscript(tp2_run, tmp_path):
    import onnxruntime as ort

    from visiondist.engine.export import load_trained

    out = tmp_path / "vit.onnx"
    stdout = _export(tp2_run, "format=onnx", f"out={out}")
    assert "ONNX Runtime vs PyTorch" in stdout
    trained = load_trained(tp2_run)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for batch in (1, 5):  # the batch dimension is dynamic
        x = torch.randn(batch, 3, 32, 32)
        with torch.no_grad():
            ref = trained.model(x)
        got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])
        assert torch.allclose(got, ref, atol=1e-4, rtol=0)

    script = tmp_path / "vit.pt"
    _export(tp2_run, "format=torchscript", f"out={script}")
    loaded = torch.jit.load(str(script))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(loaded(x), trained.model(x), atol=1e-5, rtol=0)


def test_export_errors_name_the_fix(tmp_path):
    result = run_cli(["format=onnx"], timeout=60, script=REPO / "tools" / "export.py")
    assert result.returncode == 2 and "run_dir= is missing" in result.stdout
    result = run_cli([f"run_dir={tmp_path}", "format=pdf"], timeout=60, script=REPO / "tools" / "export.py")
    assert result.returncode == 2 and "choose one of safetensors, onnx, torchscript" in result.stdout
    result = run_cli([f"run_dir={tmp_path}"], timeout=60, script=REPO / "tools" / "export.py")
    assert result.returncode == 2 and "holds no config.yaml" in result.stdout
