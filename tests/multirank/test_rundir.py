"""A job over several nodes and its run dir: every rank must see the one directory global rank 0
created (each writes its checkpoint shard there). A node that mounts another directory at that path
(a node-local disk) is found when the ranks start, on every rank, naming it, not at the first
checkpoint; one shared directory passes and is left as it was."""

import rundir_ranks
from helpers import spawn_ranks


def test_a_run_dir_a_node_does_not_share_stops_every_rank_naming_it(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    assert spawn_ranks(rundir_ranks.check, 2, [str(shared)] * 2) == {0: "", 1: ""}
    assert list(shared.iterdir()) == []

    private = tmp_path / "node1_private"  # what rank 1's node has at the same path
    private.mkdir()
    said = spawn_ranks(rundir_ranks.check, 2, [str(shared), str(private)])
    # every rank stops, each naming the path it was given (on a cluster: one and the same)
    assert said[1].startswith(f"the run dir {private} is not one directory on every node: rank 1")
    assert said[0].startswith(
        f"the run dir {shared} is not one directory on every node: rank 1 (on "
    )
    assert said[0].endswith(
        "Every rank writes its share of each checkpoint into it: give trainer.run_dir / "
        "trainer.output_dir a directory every node mounts (NFS, Lustre, a ReadWriteMany volume)"
    )
