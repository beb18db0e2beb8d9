"""Placement keeps TP inside nodes and spreads PP and DP. The runs through `python tools/train.py`:
tests/multirank/test_train.py."""


def test_placement_keeps_tp_inside_nodes_and_spreads_pp_and_dp():
    """The mesh order (pp, dp, tp): with 8 ranks per node, tp=4 groups never leave a node; pp groups
    do."""
    import numpy as np

    from visiondist.parallel.mesh import placement

    # pp=2, dp=2, tp=4, as init_device_mesh lays out the ranks
    grid = np.arange(16).reshape(2, 2, 4).tolist()
    nodes = tuple(r // 8 for r in range(16))
    pp, dp, tp = placement(grid, nodes)
    assert pp.startswith("pp groups [0, 8] [1, 9] [2, 10] [3, 11] ... (8 groups)") and pp.endswith(
        "across 2 nodes"
    )
    assert dp.startswith("dp groups [0, 4] [1, 5]") and dp.endswith("each inside one node")
    assert tp.startswith("tp groups [0, 1, 2, 3] [4, 5, 6, 7] [8, 9, 10, 11]") and tp.endswith(
        "each inside one node"
    )
    # 4 ranks per node: the dp groups now cross nodes, tp still does not
    _, dp, tp = placement(grid, tuple(r // 4 for r in range(16)))
    assert dp.endswith("across 2 nodes") and tp.endswith("each inside one node")
