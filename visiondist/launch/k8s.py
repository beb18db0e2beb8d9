"""Kubernetes manifests for a training job (`tools/k8s.py`): a Kubeflow Trainer v2 TrainJob or a Training Operator
PyTorchJob whose pods each run `python tools/train.py <overrides>`, which reads the pod's place in the job from the
operator's variables (`visiondist.launch.pods`) and starts the node's ranks.

What every manifest holds:
- the run dir on a shared volume (a PersistentVolumeClaim mounted at `mount`), named by the job: a pod that restarts
  (a node lost, a spot instance reclaimed) runs the same command, which continues the run from its newest checkpoint
  (trainer.resume=auto);
- `trainer.stop_timeout_s` and the pods' `terminationGracePeriodSeconds` from one figure, the time a step and a
  checkpoint take (`visiondist.launch.stop.grace_seconds`), plus the launcher's own exit: Kubernetes' SIGTERM then
  leaves every rank its checkpoint before the SIGKILL;
- shared memory for the loader workers (an in-memory emptyDir at /dev/shm; a container's default is 64 MB).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from visiondist.config import ConfigError

EXIT_MARGIN_S = 60  # the launcher's own exit after the ranks' checkpoint: the agent's shutdown, the logs flushed
KINDS = ("trainjob", "pytorchjob")


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
    workdir: str = "/workspace/visiondist"  # where the image holds the project (tools/train.py, configs/)
    data_pvc: str = ""  # a claim with the data, mounted read-only at /data
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", self.name):
            raise ConfigError(f"name={self.name!r} is not a Kubernetes name: lower-case letters, digits and '-', "
                              "63 at most, starting and ending alphanumeric")
        if self.nodes < 1 or self.gpus < 1:
            raise ConfigError(f"nodes={self.nodes} gpus={self.gpus}: both must be at least 1")

    @property
    def run_dir(self) -> str:
        return f"{self.mount.rstrip('/')}/{self.name}"

    @property
    def args(self) -> list[str]:
        """The training command's arguments: the user's overrides, then the run dir and the stop wait."""
        return [*self.overrides, f"trainer.run_dir={self.run_dir}", f"trainer.stop_timeout_s={self.grace_s}"]

    @property
    def termination_grace_s(self) -> int:
        return self.grace_s + EXIT_MARGIN_S


def default_name(overrides: list[str]) -> str:
    """A job name from the model and layout overrides (`model=vit_huge parallel=tp4` -> `vit-huge-tp4`)."""
    picked = [o.split("=", 1)[1] for o in overrides if o.startswith(("model=", "parallel="))]
    name = re.sub(r"[^a-z0-9]+", "-", "-".join(picked or ["visiondist"]).lower()).strip("-")
    return name[:63].rstrip("-")


def _volumes(spec: JobSpec) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "runs", "persistentVolumeClaim": {"claimName": spec.pvc}},
               {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts = [{"name": "runs", "mountPath": spec.mount}, {"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.data_pvc:
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": spec.data_pvc, "readOnly": True}})
        mounts.append({"name": "data", "mountPath": "/data", "readOnly": True})
    return volumes, mounts


def _env(spec: JobSpec) -> list[dict]:
    return [{"name": k, "value": v} for k, v in sorted(spec.env.items())]


def trainjob(spec: JobSpec) -> dict[str, Any]:
    """A Kubeflow Trainer v2 TrainJob on the `torch-distributed` runtime (which sets PET_NNODES, PET_NPROC_PER_NODE,
    PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT in each pod); the volumes and the grace period through a
    runtime patch of its `node` job (Trainer 2.3's runtimePatches)."""
    volumes, mounts = _volumes(spec)
    container = {"name": "node", "volumeMounts": mounts}
    pod = {"terminationGracePeriodSeconds": spec.termination_grace_s, "volumes": volumes, "containers": [container]}
    trainer: dict[str, Any] = {
        "image": spec.image,
        "command": ["python", f"{spec.workdir}/tools/train.py"],
        "args": spec.args,
        "numNodes": spec.nodes,
        "numProcPerNode": spec.gpus,
        "resourcesPerNode": {"limits": {"nvidia.com/gpu": str(spec.gpus)}},  # a quantity: a string
    }
    if spec.env:
        trainer["env"] = _env(spec)
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": spec.name},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": trainer,
            "runtimePatches": [{"manager": "visiondist", "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": pod}}}}]}}}}],
        },
    }


def pytorchjob(spec: JobSpec) -> dict[str, Any]:
    """A Training Operator PyTorchJob: one Master pod and nodes - 1 Worker pods, `nprocPerNode` ranks each. From
    Training Operator 1.7 the pods get PET_NNODES / PET_NODE_RANK / PET_NPROC_PER_NODE; before it WORLD_SIZE counts
    the pods and RANK is the pod's index, which visiondist reads as such. A failed pod restarts (OnFailure) and its
    command continues the run."""
    def replicas(count: int) -> dict[str, Any]:
        volumes, mounts = _volumes(spec)  # each replica its own (YAML would otherwise alias them)
        container: dict[str, Any] = {
            "name": "pytorch",  # the operator's container name
            "image": spec.image,
            "command": ["python", f"{spec.workdir}/tools/train.py", *spec.args],
            "resources": {"limits": {"nvidia.com/gpu": str(spec.gpus)}},
            "volumeMounts": mounts,
        }
        if spec.env:
            container["env"] = _env(spec)
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": {
            "terminationGracePeriodSeconds": spec.termination_grace_s, "containers": [container],
            "volumes": volumes}}}

    replica_specs = {"Master": replicas(1)}
    if spec.nodes > 1:
        replica_specs["Worker"] = replicas(spec.nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": spec.name},
        "spec": {"nprocPerNode": str(spec.gpus), "runPolicy": {"backoffLimit": 3},
                 "pytorchReplicaSpecs": replica_specs},
    }


def manifest(kind: str, spec: JobSpec) -> dict[str, Any]:
    if kind not in KINDS:
        raise ConfigError(f"kind={kind}: use kind=trainjob (Kubeflow Trainer v2) or kind=pytorchjob (Training "
                          "Operator v1)")
    return trainjob(spec) if kind == "trainjob" else pytorchjob(spec)


def grace_for(cfg: Any, nodes: int, gpus: int) -> int:
    """trainer.stop_timeout_s for the job: the user's, else the planned wait for a step and this node's share of
    the checkpoint (`grace_seconds`) on the layout the job resolves to, rounded up to a whole second."""
    from visiondist.launch.stop import grace_seconds
    from visiondist.plan import resolve_on

    run = resolve_on(cfg, nodes * gpus, nodes)
    return int(math.ceil(grace_seconds(cfg, run)))
