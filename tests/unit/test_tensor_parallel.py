"""Compiled TP blocks trace their collectives into one graph (torch's fake process group). TP on
gloo ranks against one process: tests/multirank/test_tensor_parallel.py."""

import pytest
import torch


@pytest.fixture
def fake_tp2():
    """A world of 2 simulated in this process (torch's fake process group: collectives return at
    once, unsummed)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from visiondist.parallel import build_layout

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield build_layout(1, 2, 1, torch.device("cpu"), 0)
    finally:
        dist.destroy_process_group()


@pytest.mark.smoke
@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_compiled_tp_blocks_trace_their_collectives_into_one_graph(fake_tp2, sp):
    """The collectives are custom ops: a compiled block traces them instead of breaking its graph at
    each (the autograd functions used to mutate a Python counter: 9 graphs for 4 blocks, 14 with
    SP). The traffic is still counted, forward and backward, also in the backward traced ahead of
    time (aot_eager), every step."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from visiondist.models.vit import VisionTransformer
    from visiondist.parallel import compile_blocks, parallelize, unwrap

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = parallelize(
        VisionTransformer(
            img_size=32, patch_size=8, num_classes=3, embed_dim=32, depth=4, num_heads=2
        ),
        fake_tp2,
        sp,
    )
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(unwrap(model), backend=counter)
    for _ in range(2):
        fake_tp2.tp_comm.reset()
        unwrap(model)(torch.randn(2, 3, 32, 32)).sum().backward()
        # per block 2 collectives forward and 2 backward; SP also gathers the tokens once on leaving
        # the blocks
        expected = {"all_gather": 18, "reduce_scatter": 16} if sp else {"all_reduce": 16}
        assert dict(fake_tp2.tp_comm.calls) == expected
    assert counter.frame_count == 1  # one graph, shared by the 4 blocks
