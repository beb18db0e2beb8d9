"""Deferred initialisation: every layout starts from the weights one process draws for the same
seed, bit for bit, and a rank's start-up holds its shards, not the whole model."""

from __future__ import annotations

from pathlib import Path

import init_ranks
import pytest
import torch
from helpers import REPO, spawn_ranks

TINY = [
    "model=vit_tiny",
    "model.depth=4",
    "model.num_heads=4",
    "data.img_size=32",
    "model.drop_path_rate=0.1",
]


def _reference(overrides: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The initial weights of `build_model` in one process after the trainer's seeding, and the
    generator state."""
    from visiondist.cli import load_config
    from visiondist.engine.build import seed_everything
    from visiondist.models import build_model

    cfg = load_config(REPO / "configs", overrides, inputs=None)
    seed_everything(cfg.trainer.seed)
    model = build_model(cfg.model)
    return {k: v.detach() for k, v in model.named_parameters()}, torch.get_rng_state()


def _assert_equal(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.equal(got[name], value), name


@pytest.fixture(scope="module")
def timm_weights(tmp_path_factory):
    """A 10-class ViT in timm's layout (fused qkv), for fine-tuning a 6-class model from."""
    from safetensors.torch import save_file

    from visiondist.cli import load_config
    from visiondist.models import build_model
    from visiondist.models.vit import to_timm_state_dict

    cfg = load_config(REPO / "configs", [*TINY, "data.num_classes=10"], inputs=None)
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("weights") / "timm10.safetensors"
    save_file(to_timm_state_dict(build_model(cfg.model).state_dict()), str(path))
    return path


def _cases(timm_weights: Path) -> dict[int, list[list[str]]]:
    return {
        2: [
            [*TINY, "parallel.tp=2"],
            [*TINY, "parallel.pp=2", "parallel.schedule=interleaved_1f1b"],
            [*TINY, "parallel=fsdp"],
            [*TINY, "parallel.tp=2", f"model.init_from={timm_weights}"],
        ],
        4: [[*TINY, "parallel.tp=2", "parallel.pp=2"]],
    }


@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.smoke), 4])
def test_every_layout_starts_from_the_weights_one_process_draws(timm_weights, ranks):
    """tp2, pp2 (interleaved: 2 stages per rank), FSDP over 2 ranks, fine-tuning from timm's layout
    under tp2; tp2 x pp2 on 4 ranks."""
    results = spawn_ranks(init_ranks.laid_out_weights, ranks, _cases(timm_weights)[ranks])
    for cases in results.values():
        for case in cases:
            ref, rng = _reference(case["overrides"])
            _assert_equal(case["state"], ref)
            assert case["buffers_ok"], case["overrides"]
            # later random draws (drop path) agree too
            assert torch.equal(case["rng"], rng), case["overrides"]
    # the fine-tuned model holds the file's weights, its new 6-class head drawn like any other
    if ranks == 2:
        from safetensors.torch import load_file

        tuned = results[0][3]["state"]
        qkv = load_file(timm_weights)["blocks.1.attn.qkv.weight"]
        assert torch.equal(tuned["blocks.1.attn.k.weight"], qkv[192:384])
        assert tuned["head.weight"].shape == (6, 192)


@pytest.mark.slow
def test_a_vit_huge_tp4_rank_starts_with_its_shards_not_the_model():
    """ViT-H/14 is 630.5M parameters, 2.52 GB in fp32; under tp4 a rank keeps 158.4M. Each rank's
    start-up must stay under a third of one full copy (it used to build the whole model on every
    rank, then shard it)."""
    full_bytes = 630.5e6 * 4
    results = spawn_ranks(
        init_ranks.start_memory,
        4,
        ["model=vit_huge", "data.img_size=224", "parallel.tp=4"],
        timeout=600,
    )
    for rank, r in results.items():
        assert r["finite"]
        assert r["kept"] == pytest.approx(158.4e6 * 4, rel=0.01), rank
        assert r["increase"] < full_bytes / 3, (rank, r["increase"] / 1e9)
