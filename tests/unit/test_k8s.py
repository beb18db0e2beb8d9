"""tools/k8s.py's manifests: validated against the operators' published API models (Kubeflow
Trainer's kubeflow-trainer-api for TrainingRuntime and TrainJob, the Training Operator's
kubeflow-training with the Kubernetes client's models for PyTorchJob; no cluster and no kubectl
here: what a model does not hold, a misspelt or misplaced key, fails the round trip), the shipped
examples in tools/k8s/ equal to what the tool writes, and what the pods get read back into the job
the manifest describes."""

import json
import re
import sys
from types import SimpleNamespace

import pytest
import yaml
from helpers import REPO

from visiondist.launch.pods import pod_job

EXAMPLE = [
    "image=registry.example.com/visiondist:1",
    "nodes=2",
    "gpus=8",
    "data_pvc=imagenet",
    "model=vit_huge",
    "parallel=tp4",
    "data=imagenet",
    "data.root=/data/imagenet",
    "trainer.precision=bf16",
]


def _write(tmp_path, *args):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import k8s
    finally:
        sys.path.pop(0)
    out = tmp_path / "job.yaml"
    assert k8s.main([*args, f"out={out}"]) == 0
    return list(yaml.safe_load_all(out.read_text())), out.read_text()


def _trainjob_round_trip(docs):
    """The job's TrainingRuntime, then the TrainJob that names it."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainingRuntime, TrainerV1alpha1TrainJob

    runtime, job = docs
    assert TrainerV1alpha1TrainingRuntime.from_dict(runtime).to_dict() == runtime
    assert TrainerV1alpha1TrainJob.from_dict(job).to_dict() == job
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": runtime["kind"],
        "name": runtime["metadata"]["name"],
    }


def _pytorchjob_round_trip(docs):
    from kubeflow.training.api_client import ApiClient

    (manifest,) = docs
    client = ApiClient()
    job = client.deserialize(SimpleNamespace(data=json.dumps(manifest)), "KubeflowOrgV1PyTorchJob")
    assert client.sanitize_for_serialization(job) == manifest


def _node_job(runtime: dict) -> dict:
    """The runtime's one replicated job (`node`): its Job spec."""
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"
    return node["template"]["spec"]


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_the_shipped_manifests_are_the_tools_and_valid(tmp_path, kind):
    pytest.importorskip("kubeflow_trainer_api")
    pytest.importorskip("kubeflow.training")
    docs, text = _write(tmp_path, f"kind={kind}", *EXAMPLE)
    # regenerate: see docs
    assert (REPO / "tools" / "k8s" / f"vit_huge_tp4_{kind}.yaml").read_text() == text
    (_trainjob_round_trip if kind == "trainjob" else _pytorchjob_round_trip)(docs)
    manifest = docs[-1]
    if kind == "trainjob":
        trainer = manifest["spec"]["trainer"]
        args = trainer["args"]
        assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 8
        assert docs[0]["spec"]["mlPolicy"]["numNodes"] == 2
        pod = _node_job(docs[0])["template"]["spec"]
    else:
        master = manifest["spec"]["pytorchReplicaSpecs"]["Master"]
        assert (
            master["replicas"] == 1
            and manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
        )
        assert manifest["spec"]["nprocPerNode"] == "8"
        pod = master["template"]["spec"]
        args = pod["containers"][0]["command"][2:]
    assert "trainer.run_dir=/runs/vit-huge-tp4" in args and "model=vit_huge" in args
    stop = int(next(a for a in args if a.startswith("trainer.stop_timeout_s=")).split("=")[1])
    # a step, then the checkpoint's write
    assert pod["terminationGracePeriodSeconds"] == stop + 60 and stop > 300
    claims = {
        v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]
    }
    assert claims == {"runs": "visiondist-runs", "dshm": None, "data": "imagenet"}
    resources = (
        trainer["resourcesPerNode"] if kind == "trainjob" else pod["containers"][0]["resources"]
    )
    # 8 ranks x (1 + 7 loader workers) CPUs (data=imagenet: num_workers=-1); Guaranteed: requests =
    # limits
    assert (
        resources["requests"]
        == resources["limits"]
        == {"cpu": "64", "memory": "113Gi", "nvidia.com/gpu": "8"}
    )


def _pod_of(docs: list[dict]) -> tuple[dict, dict]:
    """(pod spec, resources) of the documents of either kind."""
    manifest = docs[-1]
    if manifest["kind"] == "TrainJob":
        pod = _node_job(docs[0])["template"]["spec"]
        return pod, manifest["spec"]["trainer"]["resourcesPerNode"]
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return pod, pod["containers"][0]["resources"]


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_pods_request_cpu_and_memory_from_their_ranks_and_workers(tmp_path, kind):
    """CPU: a rank and its loader workers one each; memory: 6Gi a rank, 1Gi a worker, plus /dev/shm,
    whose sizeLimit holds the workers' ready batches twice; cpu= / memory= replace the figures;
    image_pull_secret= names the registry's Secret. Both manifests stay valid for their operator's
    API."""
    pytest.importorskip("kubeflow_trainer_api")
    pytest.importorskip("kubeflow.training")
    base = [
        "image=x",
        f"kind={kind}",
        "nodes=1",
        "gpus=4",
        "model=vit_small",
        "data.batch_size=1024",
        "data.img_size=224",
    ]
    docs, _ = _write(tmp_path, *base, "data.num_workers=3")
    pod, resources = _pod_of(docs)
    # /dev/shm: 4 ranks (dp4) x 3 workers x 2 batches ready x 256 images x 3 x 224 x 224 bytes,
    # twice: 1.72 GiB
    assert (
        resources["requests"]
        == resources["limits"]
        == {"cpu": "16", "memory": "38Gi", "nvidia.com/gpu": "4"}
    )
    assert {v["name"]: v.get("emptyDir") for v in pod["volumes"]}["dshm"] == {
        "medium": "Memory",
        "sizeLimit": "2Gi",
    }
    assert "imagePullSecrets" not in pod
    docs, _ = _write(tmp_path, *base, "cpu=24", "memory=200Gi", "image_pull_secret=regcred")
    pod, resources = _pod_of(docs)
    assert (
        resources["requests"]
        == resources["limits"]
        == {"cpu": "24", "memory": "200Gi", "nvidia.com/gpu": "4"}
    )
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    (_trainjob_round_trip if kind == "trainjob" else _pytorchjob_round_trip)(docs)


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_rdma_asks_each_pod_for_the_adapter_and_the_right_to_pin_memory(tmp_path, capsys, kind):
    """rdma=rdma/ib:1 adds the device plugin's resource beside the GPUs and IPC_LOCK to the
    container (NCCL pins its InfiniBand buffers); without it a job of several pods is told NCCL
    runs over TCP. Both stay valid for their operator's API."""
    pytest.importorskip("kubeflow_trainer_api")
    pytest.importorskip("kubeflow.training")
    base = ["image=x", f"kind={kind}", "nodes=2", "gpus=4", "model=vit_small"]
    docs, _ = _write(tmp_path, *base)
    pod, resources = _pod_of(docs)
    assert "rdma/ib" not in resources["limits"] and "securityContext" not in pod["containers"][0]
    said = capsys.readouterr().err
    assert "between the 2 pods NCCL runs over the pod network" in said
    # the default name: the run dir another experiment of the same model and layout would continue
    assert "give name= for another experiment" in said
    docs, _ = _write(tmp_path, *base, "rdma=rdma/ib:1")
    pod, resources = _pod_of(docs)
    assert resources["requests"]["rdma/ib"] == resources["limits"]["rdma/ib"] == "1"
    assert resources["limits"]["nvidia.com/gpu"] == "4"
    assert pod["containers"][0]["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert "NCCL runs over" not in capsys.readouterr().err
    (_trainjob_round_trip if kind == "trainjob" else _pytorchjob_round_trip)(docs)


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_the_pods_go_where_the_cluster_keeps_its_gpus_and_the_job_waits_in_its_queue(
    tmp_path, kind
):
    """node_selector=, tolerations=, priority_class= land in every pod's spec and queue= in the
    job's Kueue label; both kinds stay valid for their operator's API. Without them none is
    written."""
    pytest.importorskip("kubeflow_trainer_api")
    pytest.importorskip("kubeflow.training")
    base = ["image=x", f"kind={kind}", "nodes=2", "gpus=4", "model=vit_small"]
    docs, _ = _write(tmp_path, *base)
    pod, _ = _pod_of(docs)
    assert not {"nodeSelector", "tolerations", "priorityClassName"} & set(pod)
    assert "labels" not in docs[-1]["metadata"]
    docs, _ = _write(
        tmp_path,
        *base,
        "node_selector=nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3, pool=train",
        "tolerations=nvidia.com/gpu:NoSchedule,dedicated=ml:NoExecute,spot",
        "priority_class=high-priority",
        "queue=team-a",
    )
    (_trainjob_round_trip if kind == "trainjob" else _pytorchjob_round_trip)(docs)
    pods = (
        [_pod_of(docs)[0]]
        if kind == "trainjob"
        else [r["template"]["spec"] for r in docs[0]["spec"]["pytorchReplicaSpecs"].values()]
    )
    assert len(pods) == (1 if kind == "trainjob" else 2)  # the runtime's one; Master and Worker
    for pod in pods:
        assert pod["nodeSelector"] == {
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "pool": "train",
        }
        assert pod["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoExecute"},
            {"key": "spot", "operator": "Exists"},
        ]
        assert pod["priorityClassName"] == "high-priority"
    assert docs[-1]["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-a"}
    if kind == "trainjob":  # the runtime is the job's, not queued itself
        assert docs[0]["metadata"]["labels"] == {"trainer.kubeflow.org/framework": "torch"}


def test_a_misplaced_key_fails_the_validation(tmp_path):
    """The round trip is a check: a key the published model does not hold fails it."""
    pytest.importorskip("kubeflow_trainer_api")
    pytest.importorskip("kubeflow.training")
    docs, _ = _write(tmp_path, "kind=trainjob", *EXAMPLE)
    docs[1]["spec"]["trainer"]["numProcsPerNode"] = 8
    with pytest.raises(AssertionError):
        _trainjob_round_trip(docs)
    docs, _ = _write(tmp_path, "kind=trainjob", *EXAMPLE)
    docs[0]["spec"]["template"]["spec"]["failurePolicy"]["maxRestart"] = 3
    with pytest.raises(AssertionError):
        _trainjob_round_trip(docs)
    docs, _ = _write(tmp_path, "kind=pytorchjob", *EXAMPLE)
    docs[0]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
        "terminationGracePeriod"
    ] = 60
    with pytest.raises(AssertionError):
        _pytorchjob_round_trip(docs)


def test_what_the_pods_of_a_trainjob_get_is_read_as_the_manifests_job(tmp_path):
    """The torch-distributed runtime's variables for the manifest's numNodes / numProcPerNode
    (PET_*), read by the pods' launcher: 2 nodes of 8 ranks, each pod its own node rank."""
    docs, _ = _write(tmp_path, "kind=trainjob", *EXAMPLE)
    trainer = docs[1]["spec"]["trainer"]
    for node in range(trainer["numNodes"]):
        env = {
            "PET_NNODES": str(trainer["numNodes"]),
            "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
            "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": "vit-huge-tp4-node-0-0.vit-huge-tp4",
            "PET_MASTER_PORT": "29500",
        }
        job = pod_job(env)
        assert (job.max_nodes, job.nproc, job.node_rank) == (2, 8, node)


@pytest.mark.parametrize(
    "args,says",
    [
        (["nodes=2", "model=vit_huge"], "image= is required"),
        (["image=x", "kind=job"], "kind=job: use kind=trainjob"),
        (["image=x", "name=Vit_Huge"], "is not a Kubernetes name"),
        (["image=x", "gpus=0"], "gpus=0: a whole number of at least 1"),
        (["image=x", "trainer.run_dir=/foo"], "the run dir is the job's"),
        (["image=x", "data=imagenet"], "data=imagenet needs data.root"),
        (
            ["image=x", "data_pvc=imagenet", "data=imagenet", "data.root=/mnt/imagenet"],
            "use a path under /data",
        ),
        (
            ["image=x", "data=imagenet", "data.root=/data/imagenet"],
            "data.root=/data/imagenet is under /data, where data_pvc=<claim> mounts the data: "
            "give data_pvc=",
        ),
        (
            ["image=x", "gpus=3", "model=vit_small", "parallel=tp2"],
            "parallel.tp=2 does not divide the 3 ranks per node: a tensor-parallel "
            "group must sit inside one node; run a multiple of 2 ranks per node "
            "(gpus=, the ranks of each pod)",
        ),
        (
            ["image=x", "nodes=1", "gpus=6", "model=vit_base", "parallel=tp4"],
            "world size 6 is not divisible by parallel.tp x parallel.pp = 4: run a multiple of 4 "
            "ranks (nodes= x gpus=)",
        ),
        (["image=x", "cpu=lots"], "cpu=lots: give the CPUs of each pod as Kubernetes writes them"),
        (
            ["image=x", "memory=512Mi"],
            "memory=512Mi is below what the pod's 8 ranks need: 6Gi a rank",
        ),
        (
            ["image=x", "model=vit_huge", "memory=4Gi"],
            "make 49Gi without a loader worker: give memory=65Gi (the planned "
            "figure, with 2 loader workers a rank at 1Gi each), or at least "
            "49Gi with fewer workers (data.num_workers)",
        ),
        (
            ["image=x", "image_pull_secret=Reg_Cred"],
            "image_pull_secret=Reg_Cred is not a Kubernetes Secret name",
        ),
        (["image=x", "trainer.accelerator=cpu"], "the pods ask for GPUs"),
        (
            ["image=x", "gpus=8", "trainer.devices=2"],
            "trainer.devices=2 but each pod starts gpus=8 ranks",
        ),
        (["image=bad image"], "is not an image reference"),
        (["image=x", "pvc=Bad_Claim"], "pvc=Bad_Claim is not a Kubernetes claim name"),
        (["image=x", "out=/nonexistent/dir/job.yaml"], "cannot write it"),
        (
            ["image=x", "trainer.resume=null"],
            "trainer.resume=null: a restarted pod runs the command again, and a run dir that "
            "holds a run refuses a new start (exit code 2, a configuration error): drop "
            "trainer.resume; the pods continue their run dir /runs/visiondist",
        ),
        (
            ["image=x", "name=again", "trainer.resume=/runs/old/checkpoints/step_10"],
            "every restart would go back to that checkpoint, since the pods continue their run "
            "dir /runs/again (trainer.resume=auto): to start from it, copy its directory into "
            "/runs/again/checkpoints/ on the claim",
        ),
        (["image=x", "restarts=-1"], "restarts=-1: a whole number of at least 0"),
        (["image=x", "rdma=ib"], "rdma=ib: give the cluster's RDMA resource and its count"),
        (["image=x", "rdma=nvidia.com/gpu:1"], "the GPUs are gpus="),
        (["image=x", "node_selector=pool"], "node_selector=pool: 'pool' needs a value"),
        (
            ["image=x", "node_selector=a/b/c=1"],
            "'a/b/c' is not a Kubernetes label key",
        ),
        (
            ["image=x", "node_selector=pool=a b"],
            "'a b' is not a Kubernetes label value",
        ),
        (
            ["image=x", "tolerations=nvidia.com/gpu:NoSchedul"],
            "is not <key>[=<value>][:<effect>] with an effect of NoSchedule, PreferNoSchedule, "
            "NoExecute",
        ),
        (["image=x", "queue=Team_A"], "queue=Team_A is not a Kueue LocalQueue name"),
        (["image=x", "priority_class=High"], "priority_class=High is not a PriorityClass name"),
    ],
)
def test_bad_keys_are_one_line_naming_the_fix(tmp_path, capsys, args, says):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import k8s
    finally:
        sys.path.pop(0)
    assert k8s.main(args) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
    # the pods' knobs are this tool's keys
    assert "torchrun" not in err and "(trainer.devices" not in err, err


def test_memory_between_the_ranks_floor_and_the_plan_says_what_it_holds(tmp_path, capsys):
    """8 ranks of the built-in set's 2 loader workers: 49Gi without workers, 65Gi planned; 60Gi
    holds one worker a rank, which the tool's line says with the setting that fits it (the manifest
    keeps the user's figure)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import k8s
    finally:
        sys.path.pop(0)
    out = tmp_path / "job.yaml"
    assert k8s.main(["image=x", "model=vit_huge", "memory=60Gi", f"out={out}"]) == 0
    err = capsys.readouterr().err
    assert (
        "memory=60Gi is below the planned 65Gi: beside the 8 ranks (48Gi) and /dev/shm (1Gi) it "
        "leaves room for 1 of the 2 loader workers a rank the pods would start (1Gi each): add "
        "data.num_workers=1 to the command or give memory=65Gi, else the pods may be killed for "
        "memory"
    ) in err, err
    assert "memory: 60Gi" in out.read_text()


@pytest.mark.parametrize(
    "kind,says",
    [
        (
            "trainjob",
            [
                "on failure (a crash, a lost node, a pod killed): every pod is recreated once all "
                "are gone (TrainingRuntime vit-huge), at most 3 times, {kept}",
                "on a stop (SIGTERM: a drained or preempted node): the pods checkpoint the step "
                "and the job restarts from it, without using a restart, where the node leaves "
                "them the {grace} s grace period; a spot reclaim with less notice is a failure. "
                "These rules on exit codes need JobSet 0.10 or newer on the cluster: an older "
                "JobSet drops them, and a stop then ends the job (docs/multi-node.md)",
                "on a configuration error (exit code 2): the job ends at once (a restart would "
                "repeat it)",
            ],
        ),
        (
            "pytorchjob",
            [
                "on failure (a crash, a lost node, a pod killed): the failed pod restarts, and "
                "every other pod through its failed collectives, {kept}; the Training Operator "
                "counts each pod's restarts, so backoffLimit 6 (3 x 2 pods) allows about 3 "
                "failures",
                "on a stop (SIGTERM: a drained or preempted node, {grace} s to checkpoint the "
                "step): the pods restart from that checkpoint, and the restarts count against the "
                "backoffLimit as a failure's do (kind=trainjob does not count them)",
                "on a configuration error (exit code 2): the pods restart too, until the "
                "backoffLimit (kind=trainjob ends the job at once)",
            ],
        ),
    ],
)
def test_the_tool_says_what_a_pod_failure_does_to_each_kind_of_job(tmp_path, capsys, kind, says):
    """What the manifests hold for it, and the lines that say it. A TrainJob has no restart field:
    its own TrainingRuntime's JobSet restarts it, every pod at once (a static rendezvous has no
    place for one new pod), after the old ones are gone (BlockingRecreate: none is still writing
    the checkpoint the new ones read), `restarts=` times. The Job's podFailurePolicy fails it on
    exit code 2 (a configuration error) and 143 (a stop: the ranks checkpointed), and the JobSet's
    rules, on the Job controller's message naming the code, end the job on the first and restart
    it uncounted on the second (the configuration error's rule first: a JobSet that drops the
    patterns ends the job rather than restart it without end). A PyTorchJob's backoffLimit is
    `restarts` x the pods, since the Training Operator counts every pod's container restarts. From
    where: the newest checkpoint of the default 30-minute period, or a stop's without one."""
    docs, _ = _write(tmp_path, "image=x", "model=vit_huge", f"kind={kind}")
    kept = "from its newest checkpoint (one every 30 minutes: a failure loses up to 30 minutes)"
    err = capsys.readouterr().err
    grace = _pod_of(docs)[0]["terminationGracePeriodSeconds"]
    for line in says:
        assert line.format(kept=kept, grace=grace) in err.splitlines(), err
    out = tmp_path / "job.yaml"
    assert (
        f"kubectl apply -f {out} starts it; kubectl delete -f {out} stops it (the pods checkpoint "
        f"their step, up to {grace} s) and removes the "
    ) in err
    assert "trainer.checkpoint_every_min" not in str(docs)  # the default, not an override
    _write(tmp_path, "image=x", "model=vit_huge", f"kind={kind}", "trainer.checkpoint_every=500")
    assert "from its newest checkpoint (one every 500 steps or 30 minutes: a failure" in (
        capsys.readouterr().err
    )
    _write(tmp_path, "image=x", "model=vit_huge", f"kind={kind}", "trainer.checkpoint_every_min=0")
    assert (
        "from a stop's checkpoint, else from step 1 (trainer.checkpoint_every_min=0: none during "
        "the run; give trainer.checkpoint_every_min=<minutes> to bound what a failure loses)"
        in capsys.readouterr().err
    )
    again, _ = _write(tmp_path, "image=x", "model=vit_huge", f"kind={kind.upper()}", "restarts=7")
    _write(tmp_path, "image=x", "model=vit_huge", f"kind={kind}", "restarts=0")
    never = capsys.readouterr().err
    if kind == "pytorchjob":
        (manifest,) = docs
        assert manifest["spec"]["runPolicy"]["backoffLimit"] == 6  # 3 failures x 2 pods
        assert manifest["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "OnFailure"
        assert again[0]["spec"]["runPolicy"]["backoffLimit"] == 14
        assert "the job ends (restarts=0: backoffLimit 0); restarts=<n> restarts it" in never
        assert "the job ends with that checkpoint (kind=trainjob restarts it)" in never
        return
    assert "a pod killed): the job ends (restarts=0); restarts=<n> recreates its pods" in never
    assert "the job restarts from it, without using a restart" in never
    _trainjob_round_trip(docs)
    runtime, job = docs
    assert "restartPolicy" not in str(job) and "failurePolicy" not in str(job)
    assert runtime["kind"] == "TrainingRuntime" and runtime["metadata"]["name"] == "vit-huge"
    jobset = runtime["spec"]["template"]["spec"]
    message = "failed with exit code {} matching FailJob rule"
    assert jobset["failurePolicy"] == {
        "maxRestarts": 3,
        "restartStrategy": "BlockingRecreate",
        "rules": [
            {
                "name": "ConfigurationError",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [message.format(2)],
            },
            {
                "name": "Stopped",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": [message.format(143)],
            },
        ],
    }
    # the Job controller's message for a FailJob rule (kubernetes pkg/controller/job), which the
    # patterns match: "Container %s for pod %s/%s failed with exit code %v matching %v rule at
    # index %d"
    for index, code in enumerate((2, 143)):
        said = (
            f"Container node for pod default/vit-huge-node-0-0-x failed with exit code {code} "
            f"matching FailJob rule at index {index}"
        )
        matched = [
            r["name"]
            for r in jobset["failurePolicy"]["rules"]
            if re.search(r["onJobFailureMessagePatterns"][0], said)
        ]
        assert matched == [("ConfigurationError", "Stopped")[index]], matched
    node = _node_job(runtime)
    # any failed pod fails its Job at once, which restarts the JobSet
    assert node["backoffLimit"] == 0 and node["template"]["spec"]["restartPolicy"] == "Never"
    assert node["podFailurePolicy"]["rules"] == [
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "node", "operator": "In", "values": [code]},
        }
        for code in (2, 143)
    ]
    # the Trainer gives the TrainJob's image, command and resources to this job's `node` container
    assert runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["metadata"] == {
        "labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    }
    assert [c["name"] for c in node["template"]["spec"]["containers"]] == ["node"]
    assert (
        _node_job(again[0]) == node
        and again[0]["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] == 7
    )


def test_a_configuration_error_exits_with_the_code_the_job_fails_on(tmp_path, capsys):
    """The runtime's podFailurePolicy ends the job on exit code 2 instead of restarting it: that is
    what a pod's tools/train.py exits with on a configuration error (here: data.root missing on the
    volume), which every restart would repeat; in this process, before any rank starts."""
    from visiondist.launch.k8s import CONFIG_ERROR_EXIT

    sys.path.insert(0, str(REPO / "tools"))
    try:
        import train
    finally:
        sys.path.pop(0)
    argv = ["data=imagenet", f"data.root={tmp_path / 'absent'}", f"trainer.run_dir={tmp_path}/r"]
    assert train.main(argv) == CONFIG_ERROR_EXIT == 2
    assert "error: data.root=" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,says",
    [
        (
            ["trainer.checkpoint_every_min=1"],
            "checkpoint cost: a write is planned at 102 s a node (50 MB/s, a slow shared file "
            "system), longer than the 1-minute period, so the job would mostly checkpoint: give "
            "trainer.checkpoint_every_min=35 (the write 5% of the time) or more",
        ),
        (
            [],
            "checkpoint cost: training waits for each write, planned at 102 s a node (50 MB/s, a "
            "slow shared file system): 6% of its time at one every 30 minutes; "
            "trainer.checkpoint_async=true overlaps the write",
        ),
        (
            ["trainer.checkpoint_async=true"],
            "checkpoint cost: each write (planned at 102 s a node) overlaps training "
            "(trainer.checkpoint_async=true); each rank keeps one more copy of its training state "
            "in host memory, 2.6 GB, which the pods' memory counts",
        ),
    ],
)
def test_what_a_checkpoint_costs_is_said_with_the_settings_that_lower_it(
    tmp_path, capsys, args, says
):
    """ViT-H tp4 on 2 x 8 GPUs: 2.6 GB of training state a rank, written once per data-parallel
    copy, 102 s a node at the planned 50 MB/s. A period shorter than the write is said so with the
    period that keeps it at 5%; checkpoint_async adds each rank's copy of its state to the pods'
    memory (113Gi -> 137Gi: 3 GiB more for each of the 8 ranks)."""
    docs, _ = _write(tmp_path, *EXAMPLE, *args)
    assert says in capsys.readouterr().err
    memory = _pod_of(docs)[1]["limits"]["memory"]
    assert memory == ("137Gi" if "trainer.checkpoint_async=true" in args else "113Gi")
