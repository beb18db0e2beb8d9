"""trainer.fp8: the blocks' linear layers trained in float8 by torchao (engine/fp8.py). On
the CPU torch's float8 matmul is a slow reference path, so the models here are tiny; tensorwise is
the recipe torch 2.11's CPU kernel has (rowwise needs a GPU there). The end-to-end run:
tests/multirank/test_train.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import REPO

from visiondist.config import ConfigError
from visiondist.models.vit import VisionTransformer
from visiondist.parallel import transformer_blocks

pytest.importorskip("torchao")
CONFIGS = REPO / "configs"


def _vit(embed_dim: int = 64) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(
        img_size=32, patch_size=8, num_classes=10, embed_dim=embed_dim, depth=2, num_heads=2
    )


def _float8(model) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def test_only_the_blocks_linear_layers_become_float8_under_their_own_names():
    from visiondist.engine.fp8 import to_float8

    model = _vit()
    keys = list(model.state_dict())
    converted, seen = to_float8(transformer_blocks(model), "tensorwise", "all")
    assert (converted, seen) == (12, 12)  # q, k, v, proj, fc1, fc2 in each of 2 blocks
    assert sorted(_float8(model)) == sorted(
        f"blocks.{b}.{layer}"
        for b in range(2)
        for layer in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc1", "mlp.fc2")
    )
    assert list(model.state_dict()) == keys  # checkpoints, EMA and export see the same tensors
    narrow = _vit(embed_dim=40)  # 40 features: not a multiple of 16, which float8 matmuls need
    assert to_float8(transformer_blocks(narrow), "tensorwise", "all") == (0, 12) and not _float8(
        narrow
    )
    mlp = _vit()  # trainer.fp8_layers=mlp: fc1 and fc2 alone, the attention's projections bf16
    assert to_float8(transformer_blocks(mlp), "rowwise", "mlp") == (4, 12)
    assert sorted(_float8(mlp)) == sorted(
        f"blocks.{b}.mlp.{layer}" for b in range(2) for layer in ("fc1", "fc2")
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_auto_converts_the_layers_torchaos_filter_picks(recipe):
    """trainer.fp8_layers=auto (the default) converts exactly the layers torchao's own filter picks
    for the recipe, named here for ViT-B/L/H (rowwise: ViT-B and ViT-L none, ViT-H fc1; tensorwise:
    fc1 for ViT-B and ViT-L, every layer of ViT-H). The models are built on the meta device: no
    memory, no matmul."""
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    from visiondist.cli import load_config
    from visiondist.engine.fp8 import to_float8
    from visiondist.models import build_model

    expected = {
        ("rowwise", "vit_base"): set(),
        ("rowwise", "vit_large"): set(),
        ("rowwise", "vit_huge"): {"mlp.fc1"},
        ("tensorwise", "vit_base"): {"mlp.fc1"},
        ("tensorwise", "vit_large"): {"mlp.fc1"},
        ("tensorwise", "vit_huge"): {
            "attn.q",
            "attn.k",
            "attn.v",
            "attn.proj",
            "mlp.fc1",
            "mlp.fc2",
        },
    }
    torchaos = _auto_filter_for_recipe(recipe, filter_fqns=[])
    for name in ("vit_base", "vit_large", "vit_huge"):
        cfg = load_config(CONFIGS, [f"model={name}"], inputs=None)
        with torch.device("meta"):
            model = build_model(cfg.model)
        blocks = transformer_blocks(model)
        picked = {
            f"blocks.{i}.{n}"
            for i, b in enumerate(blocks)
            for n, m in b.named_modules()
            if isinstance(m, torch.nn.Linear) and torchaos(m, f"blocks.{i}.{n}")
        }
        converted, seen = to_float8(blocks, recipe)
        assert set(_float8(model)) == picked, name
        assert {n.split(".", 2)[2] for n in picked} == expected[(recipe, name)], name
        assert (converted, seen) == (len(picked), 6 * len(blocks))


def test_float8_training_follows_bf16():
    """Five AdamW steps of the same model on one batch: the float8 run's losses stay within 2% of
    bf16's and its first gradients point the same way (cosine > 0.99 for every converted weight)."""
    from visiondist.engine.fp8 import to_float8

    g = torch.Generator().manual_seed(1)
    # fit one
    batches = [
        (torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
    ] * 5
    ref = _vit()
    fp8 = copy.deepcopy(ref)
    # 64 wide: torchao's filter would keep them bf16
    to_float8(transformer_blocks(fp8), "tensorwise", "all")

    def train(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, first = [], None
        for images, labels in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(images).float(), labels)
            loss.backward()
            if first is None:
                first = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, first

    (bf16_losses, bf16_grads), (fp8_losses, fp8_grads) = train(ref), train(fp8)
    assert fp8_losses == pytest.approx(bf16_losses, rel=0.02)
    assert bf16_losses[-1] < bf16_losses[0]  # it trained
    for name in _float8(fp8):
        a, b = bf16_grads[f"{name}.weight"].flatten(), fp8_grads[f"{name}.weight"].flatten()
        assert F.cosine_similarity(a, b, dim=0) > 0.99, name


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.fp8=tensorwise"], "set trainer.precision=bf16 too (not 32)"),
        (
            ["trainer.fp8=rowwise", "trainer.precision=bf16", "parallel.tp=2", "model.num_heads=2"],
            "float8 layers are not tensor parallel here",
        ),
        (
            [
                "trainer.fp8=tensorwise",
                "trainer.precision=bf16",
                "model=fasterrcnn_mobilenet_v3",
                "data=shapes_coco",
            ],
            "runs transformer blocks' linear layers in float8; fasterrcnn_mobilenet_v3 has none",
        ),
        (
            ["trainer.fp8=e4m3"],
            "trainer.fp8='e4m3' is not supported: use one of off, tensorwise, rowwise",
        ),
    ],
)
def test_bad_fp8_settings_are_refused_naming_the_fix(overrides, message):
    from visiondist.cli import load_config
    from visiondist.plan import check

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check(load_config(CONFIGS, overrides, inputs=None))


def test_fp8_without_torchao_says_how_to_install_it(monkeypatch):
    import importlib.util

    from visiondist.cli import load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install -e '.\[fp8\]'"):
        load_config(CONFIGS, ["trainer.fp8=rowwise", "trainer.precision=bf16"], inputs=None)
