"""Our ViT equals timm's VisionTransformer: same logits from the same weights, state dicts convert both ways."""

import pytest
import timm
import torch

from visiondist.config import compose
from visiondist.models import build_model
from visiondist.models.vit import VisionTransformer, from_timm_state_dict, to_timm_state_dict
from helpers import REPO

VARIANTS = ["vit_tiny", "vit_small", "vit_base", "vit_large", "vit_huge", "vit_giant"]


def _pair(img_size=64, num_classes=7):
    torch.manual_seed(0)
    ours = VisionTransformer(img_size=img_size, patch_size=16, num_classes=num_classes, embed_dim=192, depth=3,
                             num_heads=3)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=num_classes, img_size=img_size,
                            depth=3)
    return ours.eval(), ref.eval()


def test_timm_weights_give_timm_logits():
    ours, ref = _pair()
    ours.load_state_dict(from_timm_state_dict(ref.state_dict()), strict=True)
    x = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        diff = (ours(x) - ref(x)).abs().max().item()
    assert diff <= 1e-5, diff


def test_our_weights_load_into_timm_strictly_and_match():
    ours, ref = _pair()
    torch.manual_seed(1)
    ours.reset_parameters()
    converted = to_timm_state_dict(ours.state_dict())
    assert set(converted) == set(ref.state_dict())
    ref.load_state_dict(converted, strict=True)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (ours(x) - ref(x)).abs().max().item() <= 1e-5
    back = from_timm_state_dict(converted)
    for key, value in ours.state_dict().items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize("name", VARIANTS)
def test_configs_have_timm_shapes(name):
    """Every model config builds exactly the tensors timm's namesake has (checked on the meta device, no memory)."""
    cfg = compose(REPO / "configs", [f"model={name}", "data.img_size=224", "data.num_classes=1000"])
    with torch.device("meta"):
        ours = build_model(cfg.model)
        ref = timm.create_model(cfg.model.timm_name, pretrained=False, num_classes=1000)
    ours_shapes = {k: v.shape for k, v in to_timm_state_dict(ours.state_dict()).items()}
    ref_shapes = {k: v.shape for k, v in ref.state_dict().items()}
    assert ours_shapes == ref_shapes
