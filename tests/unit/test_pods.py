"""The pods' environments of each Kubernetes contract (visiondist/launch/pods.py), as the operators
set them, read into the node's place in the job; what cannot be read is one line naming the
variables found."""

import pytest

from visiondist.config import ConfigError
from visiondist.launch.pods import PodJob, pod_job

# what each operator sets in the second pod of a 2-pod job with 8 processes per pod
TRAINJOB = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "8",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "vit-node-0-0.vit",
    "PET_MASTER_PORT": "29500",
}
PYTORCHJOB = {
    "MASTER_ADDR": "vit-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "16",
    "RANK": "1",
    # Training Operator 1.7 on
    "PET_NPROC_PER_NODE": "8",
    "PET_NODE_RANK": "1",
    "PET_NNODES": "2",
}
PYTORCHJOB_OLD = {
    "MASTER_ADDR": "vit-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "2",
    "RANK": "1",
}
PYTORCHJOB_ELASTIC = {
    "PET_RDZV_BACKEND": "c10d",
    "PET_RDZV_ENDPOINT": "vit-worker-0:23456",
    "PET_RDZV_ID": "vit",
    "PET_NNODES": "1:2",
    "PET_NPROC_PER_NODE": "8",
    "PET_MAX_RESTARTS": "3",
}


@pytest.mark.parametrize(
    "env,want",
    [
        (
            TRAINJOB,
            PodJob(
                "Kubeflow Trainer / PyTorchJob",
                2,
                2,
                8,
                "static",
                "vit-node-0-0.vit:29500",
                1,
                "visiondist",
                None,
            ),
        ),
        (
            PYTORCHJOB,
            PodJob(
                "Kubeflow Trainer / PyTorchJob",
                2,
                2,
                8,
                "static",
                "vit-master-0:23456",
                1,
                "visiondist",
                None,
            ),
        ),
        (
            PYTORCHJOB_OLD,
            PodJob(
                "PyTorchJob (WORLD_SIZE read as pods)",
                2,
                2,
                None,
                "static",
                "vit-master-0:23456",
                1,
                "visiondist",
                None,
            ),
        ),
        (
            PYTORCHJOB_ELASTIC,
            PodJob("PyTorchJob (elastic)", 1, 2, 8, "c10d", "vit-worker-0:23456", None, "vit", 3),
        ),
    ],
    ids=["trainjob", "pytorchjob", "pytorchjob-before-1.7", "pytorchjob-elastic"],
)
def test_each_contract_gives_the_pods_place_in_the_job(env, want):
    assert pod_job(env) == want


def test_the_ranks_per_pod_are_the_contracts_or_ours():
    # auto / gpu: the pod's GPUs
    assert pod_job({**TRAINJOB, "PET_NPROC_PER_NODE": "auto"}).nproc is None
    assert (
        pod_job({**TRAINJOB, "PET_MASTER_ADDR": "", "MASTER_ADDR": "m"}).rdzv_endpoint == "m:29500"
    )


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"MASTER_ADDR": "m", "MASTER_PORT": "1"},
        {"WORLD_SIZE": "1", "RANK": "0"},
        {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "4"},
    ],
)
def test_no_job_of_several_pods_launches_locally(env):
    assert pod_job(env) is None


@pytest.mark.parametrize(
    "env,says",
    [
        (
            {"WORLD_SIZE": "2", "MASTER_ADDR": "m"},
            "RANK not set where WORLD_SIZE is (found MASTER_ADDR=m, WORLD_SIZE=2)",
        ),
        ({"RANK": "1"}, "WORLD_SIZE not set where RANK is (found RANK=1)"),
        (
            {"WORLD_SIZE": "2", "RANK": "0"},
            "no MASTER_ADDR / PET_MASTER_ADDR names the first pod (found RANK=0, WORLD_SIZE=2)",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "m"},
            "RANK=2 is not a pod of WORLD_SIZE=2",
        ),
        ({"PET_NNODES": "2", "MASTER_ADDR": "m"}, "no PET_NODE_RANK says which node this pod is"),
        (
            {"PET_NNODES": "1:2", "PET_NODE_RANK": "0", "MASTER_ADDR": "m"},
            "is a range but no PET_RDZV_ENDPOINT",
        ),
        ({"PET_NNODES": "two"}, "PET_NNODES='two' is neither a count nor min:max"),
        ({**TRAINJOB, "PET_NODE_RANK": "x"}, "PET_NODE_RANK='x' is not a whole number"),
    ],
    ids=[
        "no-rank",
        "no-world-size",
        "no-master",
        "rank-out-of-range",
        "no-node-rank",
        "range-without-rendezvous",
        "bad-count",
        "bad-node-rank",
    ],
)
def test_a_contract_that_cannot_be_read_is_one_line_naming_what_was_found(env, says):
    with pytest.raises(ConfigError, match=None) as error:
        pod_job(env)
    assert says in str(error.value) and "\n" not in str(error.value)
