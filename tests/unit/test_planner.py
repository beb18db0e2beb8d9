"""The activation estimate against the tensors a block saves. Static bytes per rank against real
layouts: tests/multirank/test_planner.py."""

import pytest

from visiondist.models.shape import ViTShape


@pytest.mark.parametrize(
    "dim,depth,heads,img,patch,batch",
    [(64, 4, 4, 64, 8, 8), (192, 2, 3, 224, 16, 4), (128, 3, 4, 96, 16, 16)],
)
def test_activation_estimate_is_within_a_quarter_of_the_saved_tensors(
    dim, depth, heads, img, patch, batch
):
    import torch

    from visiondist.models.vit import VisionTransformer
    from visiondist.plan.measured import saved_activation_bytes
    from visiondist.plan.memory import block_activation_bytes

    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=img, patch_size=patch, num_classes=10, embed_dim=dim, depth=depth, num_heads=heads
    )
    tokens = model.embed(torch.randn(batch, 3, img, img)).detach().requires_grad_()
    measured = saved_activation_bytes(model.blocks, tokens)
    shape = ViTShape(dim, depth, heads, 4.0, patch, img, 10)
    estimate = depth * block_activation_bytes(shape, batch, 1)
    assert 0.75 * measured <= estimate <= 1.25 * measured, (estimate, measured)
