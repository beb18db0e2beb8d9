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
