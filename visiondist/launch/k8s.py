"""Kubernetes manifests for a training job (`tools/k8s.py`): a Kubeflow Trainer v2 TrainJob with a
TrainingRuntime of its own, or a Training Operator PyTorchJob, whose pods each run `python
tools/train.py <overrides>`, which reads the pod's place in the job from the operator's variables
(`visiondist.launch.pods`) and starts the node's ranks.

What every manifest holds:
- restarts after a failure, `restarts` times: the TrainJob's runtime recreates every pod of the job
  (`training_runtime`), a PyTorchJob restarts the failed pod (restartPolicy OnFailure);
- the run dir on a shared volume (a PersistentVolumeClaim mounted at `mount`), named by the job: a
  pod that restarts (a node lost, a spot instance reclaimed) runs the same command, which continues
  the run from its newest checkpoint (trainer.resume=auto; one every trainer.checkpoint_every_min);
- `trainer.stop_timeout_s` and the pods' `terminationGracePeriodSeconds` from one figure, the time a
  step and a checkpoint take (`visiondist.launch.stop.grace_seconds`), plus the launcher's own exit:
  Kubernetes' SIGTERM then leaves every rank its checkpoint before the SIGKILL;
- shared memory for the loader workers (an in-memory emptyDir at /dev/shm; a container's default is
  64 MB), with a `sizeLimit` from the batches the workers keep ready;
- CPU and memory requested, equal to their limits (`k8s_resources.pod_resources`), so that the
  pods are Guaranteed, the last the kubelet evicts: one CPU per rank and one per loader worker, the
  memory of the ranks, their workers and /dev/shm (which counts against the pod's memory). The
  limit is the container's CPU quota, which `data.num_workers=-1` and the ranks' threads follow
  (`visiondist.utils.procenv.usable_cpus`);
- `imagePullSecrets` where the image is in a private registry;
- where the cluster asks for them, the pods' node selector, tolerations and priority class and the
  job's Kueue queue label (`visiondist.launch.k8s_scheduling`);
- with `rdma`, the cluster's RDMA device plugin's resource (`rdma/ib: 1`, ...) beside the GPUs, and
  the IPC_LOCK capability NCCL's InfiniBand transport needs to pin its buffers: without them NCCL
  between pods runs over the pod network's TCP.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from visiondist.config import ConfigError
from visiondist.launch.k8s_policy import backoff_limit
from visiondist.launch.k8s_resources import PodResources
from visiondist.launch.k8s_scheduling import Scheduling
from visiondist.launch.stop import grace_seconds
from visiondist.plan import resolve_on

# the launcher's own exit after the ranks' checkpoint: the agent's shutdown, the logs flushed
EXIT_MARGIN_S = 60
KINDS = ("trainjob", "pytorchjob")
# the label that marks the replicated job the Trainer gives the TrainJob's trainer fields to
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
# a tool's exit code for bad input (`visiondist.cli.tool.main`): a restart would repeat it
CONFIG_ERROR_EXIT = 2
# a launcher stopped by SIGTERM (128 + 15), its ranks' checkpoint written: a preempted node
STOPPED_EXIT = 143
# an extended resource (a domain, a name) and a count: rdma=rdma/ib:1
RDMA_RESOURCE = (
    r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?:[1-9][0-9]*"
)


@dataclass(frozen=True)
class JobSpec:
    name: str
    image: str
    nodes: int
    gpus: int  # per node
    overrides: list[str]  # the training command's
    grace_s: int  # trainer.stop_timeout_s
    pvc: str = "visiondist-runs"
    mount: str = "/runs"
    # where the image holds the project (tools/train.py, configs/)
    workdir: str = "/workspace/visiondist"
    data_pvc: str = ""  # a claim with the data, mounted read-only at /data
    env: dict[str, str] = field(default_factory=dict)
    resources: Optional[PodResources] = None  # None: GPUs only
    pull_secret: str = ""  # imagePullSecrets: a Secret with the registry's credentials
    restarts: int = 3  # the job's restarts after a failure (JobSet maxRestarts, backoffLimit)
    # the RDMA device plugin's resource and count per pod ("rdma/ib:1"); "": none
    rdma: str = ""
    # the pods' node selector, tolerations and priority class; the job's Kueue queue
    scheduling: Scheduling = field(default_factory=Scheduling)

    def __post_init__(self):
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.name):
            raise ConfigError(
                f"name={self.name!r} is not a Kubernetes name: lower-case letters, digits and '-', "
                "63 at most, starting and ending alphanumeric"
            )
        if self.nodes < 1 or self.gpus < 1:
            raise ConfigError(f"nodes={self.nodes} gpus={self.gpus}: both must be at least 1")
        if self.restarts < 0:
            raise ConfigError(f"restarts={self.restarts}: a whole number of at least 0")
        if self.rdma and (
            not re.fullmatch(RDMA_RESOURCE, self.rdma)
            or self.rdma.rsplit(":", 1)[0] in ("nvidia.com/gpu", "cpu", "memory")
        ):
            raise ConfigError(
                f"rdma={self.rdma}: give the cluster's RDMA resource and its count per pod, "
                "e.g. rdma=rdma/ib:1 or rdma=rdma/rdma_shared_device_a:1 (kubectl describe node "
                "lists it under Allocatable; the GPUs are gpus=, the CPUs and memory cpu= and "
                "memory=)"
            )

    @property
    def run_dir(self) -> str:
        return f"{self.mount.rstrip('/')}/{self.name}"

    @property
    def args(self) -> list[str]:
        """The training command's arguments: the user's overrides, then the run dir and the stop
        wait."""
        return [
            *self.overrides,
            f"trainer.run_dir={self.run_dir}",
            f"trainer.stop_timeout_s={self.grace_s}",
        ]

    @property
    def termination_grace_s(self) -> int:
        return self.grace_s + EXIT_MARGIN_S


def default_name(overrides: list[str]) -> str:
    """A job name from the model and layout overrides (`model=vit_huge parallel=tp4` ->
    `vit-huge-tp4`)."""
    picked = [o.split("=", 1)[1] for o in overrides if o.startswith(("model=", "parallel="))]
    name = re.sub(r"[^a-z0-9]+", "-", "-".join(picked or ["visiondist"]).lower()).strip("-")
    return name[:63].rstrip("-")


def _volumes(spec: JobSpec) -> tuple[list[dict], list[dict]]:
    shm = {"medium": "Memory", **({"sizeLimit": spec.resources.shm} if spec.resources else {})}
    volumes: list[dict[str, Any]] = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": spec.pvc}},
        {"name": "dshm", "emptyDir": shm},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "runs", "mountPath": spec.mount},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if spec.data_pvc:
        volumes.append(
            {
                "name": "data",
                "persistentVolumeClaim": {"claimName": spec.data_pvc, "readOnly": True},
            }
        )
        mounts.append({"name": "data", "mountPath": "/data", "readOnly": True})
    return volumes, mounts


def _env(spec: JobSpec) -> list[dict]:
    return [{"name": k, "value": v} for k, v in sorted(spec.env.items())]


def _resources(spec: JobSpec) -> dict[str, Any]:
    """Requests equal to limits (the Guaranteed class); quantities are strings."""
    amounts = {"cpu": spec.resources.cpu, "memory": spec.resources.memory} if spec.resources else {}
    amounts["nvidia.com/gpu"] = str(spec.gpus)
    if spec.rdma:
        resource, count = spec.rdma.rsplit(":", 1)
        amounts[resource] = count
    return (
        {"requests": dict(amounts), "limits": dict(amounts)}
        if spec.resources
        else {"limits": amounts}
    )


def _container(spec: JobSpec, container: dict[str, Any]) -> dict[str, Any]:
    """`container` with what RDMA needs of it: NCCL registers (pins) its buffers with the
    adapter."""
    if spec.rdma:
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    return container


def _pod(spec: JobSpec, containers: list[dict], volumes: list[dict]) -> dict[str, Any]:
    pod: dict[str, Any] = {"terminationGracePeriodSeconds": spec.termination_grace_s}
    if spec.pull_secret:
        pod["imagePullSecrets"] = [{"name": spec.pull_secret}]
    return {**pod, **spec.scheduling.pod_fields(), "containers": containers, "volumes": volumes}


def _metadata(spec: JobSpec) -> dict[str, Any]:
    labels = spec.scheduling.job_labels()
    return {"name": spec.name, **({"labels": labels} if labels else {})}


def training_runtime(spec: JobSpec) -> dict[str, Any]:
    """The job's own Kubeflow Trainer TrainingRuntime (named as the job): the `torch-distributed`
    runtime's JobSet (one replicated job `node` of `nodes` pods, the trainer's label, its container
    `node`, which the Trainer gives PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR
    and PET_MASTER_PORT) with the pods' volumes and grace period, restarting as a whole.

    What restarts: a pod that fails (restartPolicy Never, backoffLimit 0) fails its Job, and the
    JobSet (`failurePolicy`) deletes every pod of the job, waits until all are gone
    (BlockingRecreate: no new pod meets an old one still writing its checkpoint) and creates them
    again, `restarts` times at most; their command continues the run from its newest checkpoint. A
    pod stopped by SIGTERM (a preempted or drained node: its ranks checkpoint and exit 143) restarts
    the job without counting against `restarts`; a pod that exits 2 (a configuration error, which
    every restart would repeat) fails it at once. Both are told apart by the Job's podFailurePolicy
    (FailJob on the exit code) and the JobSet's rules on the Job's failure message, which names the
    exit code; where a message did not match, the failure is an ordinary, counted restart."""
    volumes, mounts = _volumes(spec)
    container = _container(spec, {"name": "node", "image": spec.image, "volumeMounts": mounts})
    pod = {**_pod(spec, [container], volumes), "restartPolicy": "Never"}
    job = {
        "backoffLimit": 0,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": "node", "operator": "In", "values": [code]},
                }
                for code in (CONFIG_ERROR_EXIT, STOPPED_EXIT)
            ]
        },
        "template": {"spec": pod},
    }
    rules = [
        {
            "name": name,
            "action": action,
            "onJobFailureReasons": ["PodFailurePolicy"],
            # the Job controller's message: "Container node for pod <ns>/<pod> failed with exit
            # code 143 matching FailJob rule at index 1"
            "onJobFailureMessagePatterns": [f"failed with exit code {code} matching FailJob rule"],
        }
        # a JobSet before 0.10 drops the patterns: the first rule then takes every exit-code
        # failure, which ends the job rather than restarting a configuration error without end
        for name, action, code in (
            ("ConfigurationError", "FailJobSet", CONFIG_ERROR_EXIT),
            ("Stopped", "RestartJobSetAndIgnoreMaxRestarts", STOPPED_EXIT),
        )
    ]
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainingRuntime",
        "metadata": {"name": spec.name, "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": spec.nodes, "torch": {}},
            "template": {
                "spec": {
                    "failurePolicy": {
                        "maxRestarts": spec.restarts,
                        "restartStrategy": "BlockingRecreate",
                        "rules": rules,
                    },
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "metadata": {"labels": {ANCESTOR: "trainer"}},
                                "spec": job,
                            },
                        }
                    ],
                }
            },
        },
    }


def trainjob(spec: JobSpec) -> dict[str, Any]:
    """A Kubeflow Trainer v2 TrainJob on the job's own runtime (`training_runtime`, written
    beside it): the image, the command, the nodes, the ranks per node and the pods' resources."""
    trainer: dict[str, Any] = {
        "image": spec.image,
        "command": ["python", f"{spec.workdir}/tools/train.py"],
        "args": spec.args,
        "numNodes": spec.nodes,
        "numProcPerNode": spec.gpus,
        "resourcesPerNode": _resources(spec),
    }
    if spec.env:
        trainer["env"] = _env(spec)
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": _metadata(spec),
        "spec": {
            "runtimeRef": {
                "apiGroup": "trainer.kubeflow.org",
                "kind": "TrainingRuntime",
                "name": spec.name,
            },
            "trainer": trainer,
        },
    }


def pytorchjob(spec: JobSpec) -> dict[str, Any]:
    """A Training Operator PyTorchJob: one Master pod and nodes - 1 Worker pods, `nprocPerNode`
    ranks each. From Training Operator 1.7 the pods get PET_NNODES / PET_NODE_RANK /
    PET_NPROC_PER_NODE; before it WORLD_SIZE counts the pods and RANK is the pod's index, which
    visiondist reads as such. A failed pod restarts (OnFailure) and its command continues the
    run; the backoffLimit allows `restarts` failures of the job (`k8s_policy.backoff_limit`)."""

    def replicas(count: int) -> dict[str, Any]:
        volumes, mounts = _volumes(spec)  # each replica its own (YAML would otherwise alias them)
        container: dict[str, Any] = {
            "name": "pytorch",  # the operator's container name
            "image": spec.image,
            "command": ["python", f"{spec.workdir}/tools/train.py", *spec.args],
            "resources": _resources(spec),
            "volumeMounts": mounts,
        }
        if spec.env:
            container["env"] = _env(spec)
        return {
            "replicas": count,
            "restartPolicy": "OnFailure",
            "template": {"spec": _pod(spec, [_container(spec, container)], volumes)},
        }

    replica_specs = {"Master": replicas(1)}
    if spec.nodes > 1:
        replica_specs["Worker"] = replicas(spec.nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(spec),
        "spec": {
            "nprocPerNode": str(spec.gpus),
            "runPolicy": {"backoffLimit": backoff_limit(spec.restarts, spec.nodes)},
            "pytorchReplicaSpecs": replica_specs,
        },
    }


def manifests(kind: str, spec: JobSpec) -> list[dict[str, Any]]:
    """The documents to apply, in order: a TrainJob's runtime, then the TrainJob; or the
    PyTorchJob."""
    if kind not in KINDS:
        raise ConfigError(
            f"kind={kind}: use kind=trainjob (Kubeflow Trainer v2) or kind=pytorchjob (Training "
            "Operator v1)"
        )
    return [training_runtime(spec), trainjob(spec)] if kind == "trainjob" else [pytorchjob(spec)]


# the launcher's knobs that a layout's refusal names, and this tool's for the same thing
_KNOBS = {
    "(trainer.devices, or torchrun's --nproc-per-node)": "(gpus=, the ranks of each pod)",
    "(trainer.devices; under torchrun, --nproc-per-node x --nnodes)": "(nodes= x gpus=)",
}


def job_layout(cfg: Any, nodes: int, gpus: int) -> Any:
    """The layout the job's pods resolve to (`RunLayout`); a refusal names this tool's keys (gpus=,
    nodes=)."""
    try:
        return resolve_on(cfg, nodes * gpus, nodes)
    except ConfigError as exc:
        line = str(exc)
        for theirs, ours in _KNOBS.items():
            line = line.replace(theirs, ours)
        raise ConfigError(line) from None


def grace_for(cfg: Any, run: Any) -> int:
    """trainer.stop_timeout_s for the job: the planned wait for a step and this node's share of the
    checkpoint (`grace_seconds`) on the job's layout `run` (`job_layout`), rounded up to a whole
    second."""
    return int(math.ceil(grace_seconds(cfg, run)))
