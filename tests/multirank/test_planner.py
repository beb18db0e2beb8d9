"""The memory model's static bytes per rank equal what each rank of a real layout holds, byte for
byte."""

import planner_ranks
import pytest
from helpers import spawn_ranks

from visiondist.models.shape import ViTShape
from visiondist.plan.memory import rank_memory

SHAPE = ViTShape(
    embed_dim=32, depth=6, num_heads=4, mlp_ratio=3.0, patch_size=8, img_size=32, num_classes=5
)


@pytest.mark.parametrize(
    "dims", [(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 1, 2)], ids=["ddp", "tp2", "pp2", "tp2xpp2"]
)
def test_parameter_gradient_and_optimizer_bytes_are_exact(dims):
    pp, dp, tp = dims
    results = spawn_ranks(planner_ranks.run, pp * dp * tp, dims)
    for measured in results.values():
        predicted = rank_memory(
            SHAPE, dp, tp, pp, planner_ranks.BATCH, microbatches=2, pp_rank=measured["pp_rank"]
        )
        assert predicted.params == measured["params"]
        assert predicted.grads == measured["grads"]
        assert predicted.optimizer == measured["optimizer"]
        assert predicted.detail["param_tensors"] == measured["tensors"]
        # ddp and tp2: the estimate covers TP-sharded activations too
        if measured["activations"] is not None:
            estimate = predicted.activations
            assert 0.75 * measured["activations"] <= estimate <= 1.25 * measured["activations"], (
                estimate,
                measured,
            )


def test_fsdp_shards_are_exact_per_rank():
    """FSDP2 splits dim 0 of every tensor into ceil(rows / n) chunks: rank 0 holds the most, and the
    planner counts rank 0's bytes (what each rank's padded storage needs)."""
    from visiondist.plan.memory import FLOAT, fsdp_shard, optimizer_bytes

    results = spawn_ranks(planner_ranks.run, 2, (1, 2, 1), True)
    for measured in results.values():
        shard = fsdp_shard(SHAPE, 2, measured["rank"])
        assert measured["params"] == measured["grads"] == FLOAT * shard.elements
        assert measured["optimizer"] == optimizer_bytes(shard, "adamw")
    assert (
        results[0]["params"] == rank_memory(SHAPE, 2, 1, 1, planner_ranks.BATCH, fsdp=True).params
    )
    # nothing lost
    assert sum(r["params"] for r in results.values()) == FLOAT * fsdp_shard(SHAPE, 1).elements
