"""The memory model's static bytes per rank equal what each rank of a real layout holds, byte for byte."""

import pytest

import planner_ranks
from visiondist.launch import spawn_local
from visiondist.parallel.planner import ViTShape, rank_memory

SHAPE = ViTShape(embed_dim=32, depth=6, num_heads=4, mlp_ratio=3.0, patch_size=8, img_size=32, num_classes=5)


@pytest.mark.parametrize("dims", [(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2)], ids=["ddp", "tp2", "pp2", "tp2xpp2"])
def test_parameter_gradient_and_optimizer_bytes_are_exact(dims):
    pp, dp, tp = dims
    results = spawn_local(planner_ranks.run, pp * dp * tp, dims)
    for measured in results.values():
        predicted = rank_memory(SHAPE, dp, tp, pp, planner_ranks.BATCH, microbatches=2, pp_rank=measured["pp_rank"])
        assert predicted.params == measured["params"]
        assert predicted.grads == measured["grads"]
        assert predicted.optimizer == measured["optimizer"]
        assert predicted.detail["param_tensors"] == measured["tensors"]


@pytest.mark.parametrize("dim,depth,heads,img,patch,batch", [(64, 4, 4, 64, 8, 8), (192, 2, 3, 224, 16, 4),
                                                             (128, 3, 4, 96, 16, 16)])
def test_activation_estimate_is_within_a_quarter_of_the_saved_tensors(dim, depth, heads, img, patch, batch):
    import torch

    from visiondist.models.vit import VisionTransformer
    from visiondist.parallel.planner import block_activation_bytes, saved_activation_bytes

    torch.manual_seed(0)
    model = VisionTransformer(img_size=img, patch_size=patch, num_classes=10, embed_dim=dim, depth=depth,
                              num_heads=heads)
    tokens = model.embed(torch.randn(batch, 3, img, img)).detach().requires_grad_()
    measured = saved_activation_bytes(model.blocks, tokens)
    shape = ViTShape(dim, depth, heads, 4.0, patch, img, 10)
    estimate = depth * block_activation_bytes(shape, batch, 1)
    assert 0.75 * measured <= estimate <= 1.25 * measured, (estimate, measured)
