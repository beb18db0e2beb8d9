"""Write the Kubernetes manifest of a training job:

    python tools/k8s.py image=registry.example.com/visiondist:1 nodes=2 gpus=8 model=vit_huge \
        parallel=tp4 out=job.yaml
    kubectl apply -f job.yaml

kind=trainjob (default): a Kubeflow Trainer v2 TrainJob and its own TrainingRuntime (the
torch-distributed runtime's JobSet, recreating every pod after a failure, restarts= times);
kind=pytorchjob: a Training Operator PyTorchJob. Each pod runs `python tools/train.py <the
overrides>`, which reads its place in the job from the operator's variables and starts its node's
ranks. The run dir is on the claim `pvc=` (mounted at /runs, named by the job), so a restarted pod
continues the run from its newest checkpoint (one every trainer.checkpoint_every_min, 30 by
default); the pods' grace period after SIGTERM is the time for a step and a checkpoint
(trainer.stop_timeout_s) plus a minute; each pod requests (and is limited to) the CPUs and memory of
its ranks and loader workers (cpu=, memory=) and a sized /dev/shm. The overrides are checked as
tools/train.py checks them. tools/k8s/ holds the two manifests of the example above
(`visiondist.launch.k8s`).
"""

import sys
from functools import partial
from pathlib import Path

from visiondist.api.k8s_job import k8s_job
from visiondist.cli import Tool
from visiondist.cli import main as cli_main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TOOL = Tool(
    name="k8s.py",
    about=(
        "Write a Kubernetes manifest (Kubeflow Trainer TrainJob, or Training Operator PyTorchJob) "
        "that trains with the given overrides on nodes x gpus, the run dir on a shared volume, "
        "the grace period after SIGTERM long enough for a step and a checkpoint."
    ),
    reads="configs/ as tools/train.py (the overrides are checked; no data is read)",
    writes="the manifest as YAML on standard output, or to out=FILE",
    examples=(
        "python tools/k8s.py image=registry.example.com/visiondist:1 nodes=2 gpus=8 "
        "model=vit_huge parallel=tp4",
        "python tools/k8s.py kind=pytorchjob image=registry.example.com/visiondist:1 nodes=2 "
        "gpus=8 model=vit_huge parallel=tp4 out=vit-huge-tp4.yaml",
    ),
    keys=(
        (
            "kind=<kind>",
            "trainjob (Kubeflow Trainer v2, with a TrainingRuntime of its own; the default) or "
            "pytorchjob (Training Operator)",
        ),
        (
            "image=<image>",
            "the container image: visiondist installed, the project at workdir= (required)",
        ),
        ("nodes=<n>", "pods, one per node (default 2)"),
        ("gpus=<n>", "GPUs (ranks) per node (default 8)"),
        (
            "restarts=<n>",
            "times the job starts again after a failure, from its newest checkpoint (default 3)",
        ),
        (
            "name=<name>",
            "the job's name, and its run dir's under /runs (default: from model= and parallel=)",
        ),
        (
            "pvc=<claim>",
            "the PersistentVolumeClaim that holds the run dirs (default visiondist-runs)",
        ),
        (
            "data_pvc=<claim>",
            "a claim with the data, mounted read-only at /data (default: none; required for a "
            "data.root under /data)",
        ),
        (
            "cpu=<cpus>",
            "CPUs each pod requests and is limited to (default: one per rank and one per loader "
            "worker, data.num_workers, or 7 per rank for -1)",
        ),
        (
            "memory=<quantity>",
            "memory each pod requests and is limited to, e.g. 256Gi (default: 6Gi a rank, 1Gi a "
            "loader worker, plus /dev/shm)",
        ),
        (
            "image_pull_secret=<name>",
            "a Secret with the registry's credentials, for a private image",
        ),
        (
            "rdma=<resource>:<count>",
            "InfiniBand / RoCE for NCCL between pods: the cluster's RDMA device plugin's resource "
            "per pod, e.g. rdma=rdma/ib:1, with the IPC_LOCK capability (default: none, NCCL over "
            "the pod network's TCP)",
        ),
        (
            "node_selector=<label>=<value>[,...]",
            "node labels every pod's node must have, e.g. "
            "node_selector=nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3 (default: none)",
        ),
        (
            "tolerations=<key>[=<value>][:<effect>][,...]",
            "taints the pods tolerate, e.g. tolerations=nvidia.com/gpu:NoSchedule; without an "
            "effect, all of the taint's (default: none)",
        ),
        ("priority_class=<name>", "the pods' PriorityClass (default: the cluster's)"),
        (
            "queue=<name>",
            "the Kueue LocalQueue the job waits in (its kueue.x-k8s.io/queue-name label; default: "
            "none)",
        ),
        ("workdir=<dir>", "where the image holds the project (default /workspace/visiondist)"),
        ("out=<file>", "write the manifest there instead of standard output"),
    ),
    run_dir=False,
    multirun=False,
)


def main(argv: list[str]) -> int:
    return cli_main(TOOL, CONFIGS, argv, partial(k8s_job, configs=CONFIGS))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
