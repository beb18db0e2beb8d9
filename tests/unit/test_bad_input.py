"""Bad input found in one process (a built-in set's class count without its files, a checkpoint's
shapes from its metadata) and the fixes that keep going: position embeddings resampled for
fine-tuning, a sweep past a failed job, weights files with the usual mode, a progress bar while
evaluating. The command lines that stop with exit 2 and one `error:` line:
tests/multirank/test_bad_input.py."""

import json
import os

import pytest
import torch
from helpers import REPO

CONFIGS = REPO / "configs"


def test_c_num_classes_of_a_built_in_set_is_checked_without_its_files():
    from visiondist.cli import load_config
    from visiondist.config import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"data.num_classes=4 but data=shapes \(built in\) has 6 classes: "
        r"set data.num_classes=6",
    ):
        load_config(CONFIGS, ["data.num_classes=4", "data.root=/nonexistent"])


def test_d_checkpoint_shapes_are_read_from_its_metadata(tmp_path):
    """A DCP checkpoint directory as model.weights: its tensor shapes come from the metadata
    alone."""
    import torch.distributed.checkpoint as dcp

    from visiondist.models.weights import weight_shapes

    dcp.save(
        {"model": {"head.weight": torch.zeros(6, 4), "head.bias": torch.zeros(6)}, "optim": {}},
        checkpoint_id=str(tmp_path / "step_1"),
        no_dist=True,
    )
    assert weight_shapes(tmp_path / "step_1") == {"head.weight": (6, 4), "head.bias": (6,)}


def test_e_init_from_resamples_the_position_embedding_like_timm(tmp_path, caplog):
    """timm-layout weights made at 224 px start a 64-px model: its pos_embed is timm's resample of
    theirs (class token kept), every other tensor is theirs, and one info line says so."""
    import logging

    from safetensors.torch import save_file
    from timm.layers import resample_abs_pos_embed

    from visiondist.cli import load_config
    from visiondist.models import build_model
    from visiondist.models.vit import to_timm_state_dict

    big = load_config(CONFIGS, ["model.depth=1", "data.img_size=224"])
    torch.manual_seed(0)
    state = to_timm_state_dict(build_model(big.model).state_dict())
    save_file(state, str(tmp_path / "timm224.safetensors"))
    small = load_config(
        CONFIGS,
        [
            "model.depth=1",
            "data.img_size=64",
            f"model.init_from={tmp_path / 'timm224.safetensors'}",
        ],
    )
    with caplog.at_level(logging.INFO, logger="visiondist.models.weights"):
        model = build_model(small.model)
    expected = resample_abs_pos_embed(state["pos_embed"], new_size=[4, 4], num_prefix_tokens=1)
    assert model.pos_embed.shape == (1, 17, 192)
    torch.testing.assert_close(model.pos_embed.detach(), expected, rtol=0, atol=0)
    torch.testing.assert_close(
        model.pos_embed.detach()[:, 0], state["pos_embed"][:, 0], rtol=0, atol=0
    )
    torch.testing.assert_close(model.cls_token.detach(), state["cls_token"], rtol=0, atol=0)
    torch.testing.assert_close(
        model.blocks[0].attn.q.weight.detach(), state["blocks.0.attn.qkv.weight"][:192]
    )
    assert "pos_embed resampled from 14 x 14 to 4 x 4 patches" in caplog.text


def test_g_safetensors_files_follow_the_umask(tmp_path):
    """safetensors writes 0o600; weights and exports get 0o644 under umask 022, like every other
    output."""
    from visiondist.checkpoint.export import export
    from visiondist.checkpoint.export.trained import Trained
    from visiondist.cli import load_config
    from visiondist.models import build_model
    from visiondist.models.weights import save_weights

    old = os.umask(0o022)
    try:
        save_weights({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
        cfg = load_config(CONFIGS, ["model.depth=1"])
        files = export(
            Trained(cfg, build_model(cfg.model).eval(), tmp_path, None, None),
            "safetensors",
            tmp_path / "export" / "model.safetensors",
        )
    finally:
        os.umask(old)
    for path in (tmp_path / "model.safetensors", *files):
        assert path.stat().st_mode & 0o777 == 0o644, (path, oct(path.stat().st_mode))


def test_f_a_failed_sweep_job_is_recorded_and_the_next_one_runs(tmp_path, capsys):
    """Job 1 of 3 raises: jobs 0 and 2 still run, sweep.json and the table say which failed and why,
    the sweep exits non-zero, and the banner numbers jobs as the directories do."""
    from visiondist.cli.sweep import run_sweep

    ran = []

    def run(cfg):
        ran.append(cfg.optim.lr)
        if cfg.optim.lr == 2e-3:
            raise ValueError(
                "data.num_classes=10 but the data has 7 classes: set data.num_classes=7\nmore "
                "detail"
            )
        return 0

    code = run_sweep(
        "train.py", CONFIGS, ["optim.lr=1e-3,2e-3,3e-3", f"trainer.run_dir={tmp_path}"], run
    )
    assert code != 0 and ran == [1e-3, 2e-3, 3e-3]
    jobs = json.loads((tmp_path / "sweep.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["done", "failed (exit 1)", "done"]
    assert (
        jobs[1]["error"]
        == "ValueError: data.num_classes=10 but the data has 7 classes: set data.num_classes=7"
    )
    out = capsys.readouterr()
    assert "job 1 failed: ValueError: data.num_classes=10" in out.err
    assert "sweep: 3 of 3 jobs" in out.out and "failed (exit 1)" in out.out
    # unwrapped, after the table
    assert "1 of 3 jobs failed:\n  job 1: ValueError: data.num_classes=10" in out.err
    assert "job 0 (1 of 3): optim.lr=0.001" in out.out and "job 2 (3 of 3)" in out.out


def test_h_evaluation_shows_a_progress_bar_when_progress_is_on(monkeypatch):
    """Classification and detection evaluation draw a bar over their batches with trainer.progress
    on the main rank (also under a live training bar), and none with it off."""
    from types import SimpleNamespace

    from rich.console import Console

    from visiondist.evaluation.classification import evaluate_classification
    from visiondist.evaluation.detection import predict
    from visiondist.models.vit import VisionTransformer
    from visiondist.observe import progress
    from visiondist.observe.progress import progress_bar

    bars = []
    real_track = progress.track  # rich's, as the bars draw it
    terminal = Console(force_terminal=True)  # a terminal: bars (into a pipe, lines: below)
    monkeypatch.setattr(progress, "get_console", lambda: terminal)
    monkeypatch.setattr(
        progress, "track", lambda items, **kw: bars.append(kw) or real_track(items, **kw)
    )
    layout = SimpleNamespace(
        device=torch.device("cpu"), dp=1, is_main=True, all_reduce_dp=lambda t: t
    )
    model = VisionTransformer(
        img_size=16, patch_size=8, num_classes=3, embed_dim=16, depth=1, num_heads=2
    )
    batches = [(torch.randn(2, 3, 16, 16), torch.tensor([0, 2])) for _ in range(3)]
    train_bar = progress_bar(True, 10)  # the training bar is live while the trainer evaluates
    try:
        metrics = evaluate_classification(model, batches, layout, progress=True)
    finally:
        train_bar.stop()
    assert metrics["val_count"] == 6 and bars == [dict(description="eval", total=3, transient=True)]
    evaluate_classification(model, batches, layout, progress=False)
    assert len(bars) == 1

    loader = [([torch.zeros(3, 8, 8)], [{"image_id": torch.tensor(i)}]) for i in range(4)]
    _, seen, _ = predict(_NoBoxes(), loader, torch.device("cpu"), {}, progress=True)
    assert seen == [0, 1, 2, 3] and bars[-1] == dict(description="eval", total=4, transient=True)


def test_h_evaluation_into_a_pipe_says_how_far_it_is_every_so_often(monkeypatch, caplog):
    """No terminal, so no bar: a log line every PIPE_LINE_S seconds (0 here: every batch after the
    first) with the batches done and the time taken, so that a long evaluation is not silent."""
    from visiondist.observe import progress

    monkeypatch.setattr(progress, "PIPE_LINE_S", 0.0)
    assert not progress.get_console().is_terminal  # pytest captures the output
    with caplog.at_level("INFO"):
        assert list(progress.tracked(range(3), True)) == [0, 1, 2]
        assert list(progress.tracked(range(3), False)) == [0, 1, 2]  # trainer.progress=false
    said = [r.getMessage() for r in caplog.records if "batches in" in r.getMessage()]
    assert [line.split(" in ")[0] for line in said] == [f"eval: {k} of 3 batches" for k in range(3)]


class _NoBoxes(torch.nn.Module):
    """A detector that finds nothing."""

    def forward(self, images):
        return [
            {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0), "scores": torch.zeros(0)}
            for _ in images
        ]


def test_i_a_file_without_its_head_is_pointed_to_init_from_which_fine_tunes_from_it(
    tmp_path, caplog
):
    """A ViT saved without its classification head (a backbone to fine-tune): model.weights= refuses
    it before launch naming model.init_from=, which loads every tensor the file has and starts the
    head afresh (one line); model.init_from= of another ViT is refused before launch too."""
    import logging

    import pytest
    from safetensors.torch import save_file

    from visiondist.cli import load_config
    from visiondist.config import ConfigError
    from visiondist.models import build_model

    cfg = load_config(CONFIGS, ["model.depth=1"], inputs=None)
    torch.manual_seed(0)
    state = {
        k: v for k, v in build_model(cfg.model).state_dict().items() if not k.startswith("head.")
    }
    file = tmp_path / "backbone.safetensors"
    save_file(state, str(file))
    with pytest.raises(ConfigError) as refused:
        load_config(
            CONFIGS, ["model.depth=1", f"model.weights={file}", f"data.root={tmp_path / 'shapes'}"]
        )
    assert str(refused.value) == (
        f"model.weights={file} is model=vit_tiny without its class head (head.weight, head.bias): "
        "model.weights loads a whole model; to fine-tune from these weights give "
        f"model.init_from={file} instead (every tensor it has is loaded and the head starts "
        "afresh)"
    )
    tuned = load_config(CONFIGS, ["model.depth=1", f"model.init_from={file}"], inputs=None)
    torch.manual_seed(1)
    with caplog.at_level(logging.INFO, logger="visiondist.models.weights"):
        model = build_model(tuned.model)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    assert (
        "model.init_from: head.weight, head.bias re-initialised (the file has no classification "
        "head)" in caplog.text
    )
    # a file of another ViT: refused before launch, naming the model config of its shape
    with pytest.raises(ConfigError) as refused:
        load_config(
            CONFIGS,
            [
                "model=vit_small",
                "model.depth=1",
                f"model.init_from={file}",
                f"data.root={tmp_path / 'shapes'}",
            ],
        )
    assert str(refused.value) == (
        f"model.init_from={file} is a ViT (width 192, depth 1, patch 16, no classification "
        "head) but model=vit_small is 384 wide: use model=vit_tiny"
    )


@pytest.mark.parametrize("wrap", ["state_dict", "model_and_ema", "ddp_pth", "ddp_safetensors"])
def test_j_init_from_reads_a_training_scripts_checkpoint(tmp_path, caplog, wrap):
    """timm-layout weights inside what training scripts save: Lightning's / timm's
    `{"state_dict": ...}`, `{"model": ..., "model_ema": ...}` (the model's own read, and the line
    says which), a DDP model's `module.` keys in a torch file or a safetensors file. Checked before
    launch and loaded: every tensor but the head (4 classes here against 6) is the file's."""
    import logging

    from safetensors.torch import save_file

    from visiondist.cli import load_config
    from visiondist.models import build_model
    from visiondist.models.vit import to_timm_state_dict

    cfg = load_config(CONFIGS, ["model.depth=1", "model.num_classes=4"], inputs=None)
    torch.manual_seed(0)
    state = to_timm_state_dict(build_model(cfg.model).state_dict())
    file = tmp_path / ("ckpt.safetensors" if wrap == "ddp_safetensors" else "ckpt.pth")
    if wrap == "state_dict":
        torch.save({"state_dict": state, "epoch": 3}, file)
    elif wrap == "model_and_ema":
        ema = {k: torch.full_like(v, 7.0) for k, v in state.items()}
        torch.save({"model": state, "model_ema": ema, "optimizer": {}}, file)
    elif wrap == "ddp_pth":
        torch.save({f"module.{k}": v for k, v in state.items()}, file)
    else:
        save_file({f"module.{k}": v for k, v in state.items()}, str(file))
    tuned = load_config(CONFIGS, ["model.depth=1", f"model.init_from={file}"], inputs=None)
    with caplog.at_level(logging.INFO, logger="visiondist.models.weights"):
        model = build_model(tuned.model)
    loaded = to_timm_state_dict(model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in state.items() if not k.startswith("head."))
    total = len(model.state_dict())
    assert f"model.init_from: {total - 2} of the model's {total} tensors from {file}" in caplog.text
    if wrap == "model_and_ema":
        assert "model.init_from: read ckpt.pth's `model` (it also holds model_ema)" in caplog.text
