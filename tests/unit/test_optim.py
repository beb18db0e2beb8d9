import math
from types import SimpleNamespace

import pytest
import torch

from visiondist.engine.optim import build_optimizer, lr_factor, param_groups
from visiondist.models.vit import VisionTransformer


def test_no_weight_decay_on_norms_biases_and_embeddings():
    model = VisionTransformer(
        img_size=32, patch_size=16, num_classes=3, embed_dim=48, depth=2, num_heads=3
    )
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert {
        "pos_embed",
        "cls_token",
        "norm.weight",
        "head.bias",
        "blocks.0.attn.q.bias",
    } <= no_decay_names
    assert all(names[id(p)].endswith("weight") and p.ndim > 1 for p in decay["params"])
    assert no_decay["weight_decay"] == 0 and decay["weight_decay"] == 0.05
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    opt = build_optimizer(
        SimpleNamespace(name="sgd", lr=0.1, weight_decay=1e-4, momentum=0.9, nesterov=True), model
    )
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["nesterov"]


def test_warmup_then_cosine():
    cfg = SimpleNamespace(
        name="cosine", warmup_steps=10, warmup_start_factor=0.1, min_lr_ratio=0.01
    )
    f = [lr_factor(s, 110, cfg) for s in range(110)]
    assert math.isclose(f[0], 0.1) and math.isclose(f[5], 0.55) and math.isclose(f[10], 1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert math.isclose(f[-1], 0.01)
    assert math.isclose(f[60], 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * 50 / 99)))


def test_the_default_warmup_is_a_tenth_of_the_run_up_to_its_cap():
    """configs/schedule/*.yaml's warmup_steps=-1: a 6-step example run gets 1 step (and no warning
    that the warmup is cut), the default run (279 steps) and longer ones the cap; a count the user
    gives is kept, cut only to leave the last step out."""
    from helpers import REPO

    from visiondist.cli import load_config
    from visiondist.config import ConfigError
    from visiondist.engine.optim import warmup_length

    cosine = load_config(REPO / "configs", [], inputs=None).schedule
    step = load_config(REPO / "configs", ["schedule=step"], inputs=None).schedule
    assert cosine.warmup_steps == step.warmup_steps == -1
    assert [warmup_length(cosine, n) for n in (4, 6, 20, 100, 279, 5000)] == [0, 1, 4, 20, 30, 30]
    assert [warmup_length(step, n) for n in (6, 100, 5000)] == [1, 20, 50]
    given = load_config(REPO / "configs", ["schedule.warmup_steps=30"], inputs=None).schedule
    assert [warmup_length(given, n) for n in (6, 100)] == [5, 30]
    f = [lr_factor(s, 6, cosine) for s in range(6)]
    assert (
        f[0] == cosine.warmup_start_factor
        and f[1] == 1.0
        and math.isclose(f[-1], cosine.min_lr_ratio)
    )
    with pytest.raises(ConfigError, match=r"0 \(no warmup\) or -1 \(a fifth of the run"):
        load_config(REPO / "configs", ["schedule.warmup_steps=-2"], inputs=None)


def test_step_schedule():
    cfg = SimpleNamespace(
        name="step", warmup_steps=0, warmup_start_factor=1.0, milestones=[0.5, 0.75], gamma=0.1
    )
    f = [lr_factor(s, 100, cfg) for s in range(100)]
    assert (
        f[49] == 1.0
        and math.isclose(f[50], 0.1)
        and math.isclose(f[74], 0.1)
        and math.isclose(f[75], 0.01)
    )


def test_layer_decay_scales_each_layer_and_keeps_the_groups_of_every_rank():
    model = VisionTransformer(
        img_size=32, patch_size=16, num_classes=3, embed_dim=48, depth=3, num_heads=3
    )
    cfg = SimpleNamespace(
        name="adamw", lr=1e-3, weight_decay=0.05, betas=[0.9, 0.999], eps=1e-8, layer_decay=0.5
    )
    opt = build_optimizer(cfg, model, depth=3)
    lr_of = {
        n: g["lr"]
        for g in opt.param_groups
        for n, p in model.named_parameters()
        if any(p is q for q in g["params"])
    }
    assert lr_of["head.weight"] == lr_of["norm.bias"] == 1e-3
    assert lr_of["blocks.2.mlp.fc1.weight"] == 5e-4 and lr_of["blocks.0.attn.q.weight"] == 1.25e-4
    assert lr_of["patch_embed.proj.weight"] == lr_of["pos_embed"] == 6.25e-5
    assert len(opt.param_groups) == 2 * (3 + 2)
    # a pipeline stage holding only the last block and the head still has every group (some empty)
    from torch import nn

    stage = nn.Module()
    stage.blocks = nn.ModuleDict({"2": model.blocks[2]})
    stage.head = model.head
    groups = build_optimizer(cfg, stage, depth=3).param_groups
    assert [g["lr"] for g in groups] == [g["lr"] for g in opt.param_groups]
    assert sum(len(g["params"]) for g in groups) == len(list(stage.parameters()))
