"""A pod of a Kubernetes job started as `python tools/train.py ...` (no torchrun): the node's place
in the job read from the variables the operator sets, so that this process becomes the node's
launcher, as torchrun would; and how many ranks each pod starts (`pod_ranks`).

The contracts, and what the pod's environment holds under each:
- Kubeflow Trainer v2 (TrainJob, `torch-distributed` runtime); PyTorchJob from Training Operator
  1.7 on: `PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`, `PET_MASTER_ADDR` / `MASTER_ADDR`,
  `PET_MASTER_PORT` / `MASTER_PORT`;
- PyTorchJob with an `elasticPolicy`: `PET_NNODES=min:max`, `PET_RDZV_BACKEND`,
  `PET_RDZV_ENDPOINT`, `PET_RDZV_ID`, `PET_NPROC_PER_NODE`, `PET_MAX_RESTARTS`;
- PyTorchJob before 1.7, Alibaba PAI-DLC: `MASTER_ADDR`, `MASTER_PORT`, `WORLD_SIZE` = the number
  of **pods**, `RANK` = this pod's index.

The last is the trap: WORLD_SIZE and RANK there count pods, not processes, so a pod that starts 8
ranks must not read them as its ranks (`torch.distributed` would wait for 2 processes of a
16-process job). They are read here as nodes. Under torchrun (SageMaker, Vertex AI, a TrainJob whose
command is torchrun) the variables are torchrun's, and each rank reads its own
(`visiondist.plan.world.under_torchrun`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from visiondist.config import ConfigError
from visiondist.plan.world import find_accelerator

DEFAULT_PORT = 29500  # the Training Operator's and Trainer's default master port


@dataclass(frozen=True)
class PodJob:
    contract: str  # which contract was read, for the start-up line
    min_nodes: int
    max_nodes: int
    # ranks per node named by the contract; None: the project's own count (`per_node`)
    nproc: Optional[int]
    # "static" (every node knows its rank) or "c10d" (ranks handed out at the rendezvous)
    rdzv_backend: str
    rdzv_endpoint: str  # host:port
    node_rank: Optional[int]  # static rendezvous only
    run_id: str
    max_restarts: Optional[int]  # PET_MAX_RESTARTS; None: trainer.max_restarts

    def line(self) -> str:
        nodes = (
            str(self.max_nodes)
            if self.min_nodes == self.max_nodes
            else f"{self.min_nodes}-{self.max_nodes}"
        )
        where = (
            f"node {self.node_rank} of {nodes}"
            if self.node_rank is not None
            else f"one of {nodes} nodes"
        )
        return (
            f"{self.contract}: this pod is {where}, rendezvous {self.rdzv_backend} at "
            f"{self.rdzv_endpoint}; it starts its node's ranks"
        )


def _found(env: dict[str, str]) -> str:
    names = sorted(
        k
        for k in env
        if k.startswith("PET_") or k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    )
    return ", ".join(f"{k}={env[k]}" for k in names)


def _int(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(
            f"{name}={env[name]!r} is not a whole number (found {_found(env)})"
        ) from None


def _nodes(value: str, env: dict[str, str]) -> tuple[int, int]:
    low, _, high = value.partition(":")
    try:
        nodes = (int(low), int(high or low))
    except ValueError:
        raise ConfigError(
            f"PET_NNODES={value!r} is neither a count nor min:max (found {_found(env)})"
        ) from None
    if not 1 <= nodes[0] <= nodes[1]:
        raise ConfigError(
            f"PET_NNODES={value!r}: the node counts must be 1 <= min <= max (found {_found(env)})"
        )
    return nodes


def pod_job(env: dict[str, str]) -> Optional[PodJob]:
    """The job this pod belongs to, from its environment (module doc); None when the environment
    names no multi-node job (a workstation, or a single pod: the ranks are launched locally). Raises
    `ConfigError`, one line naming what was found, when the variables name a job but not this pod's
    place in it."""
    if "PET_NNODES" in env:
        return _torchrun_contract(env)
    if "WORLD_SIZE" in env or "RANK" in env:
        return _pods_contract(env)
    return None


def _master(env: dict[str, str], what: str) -> str:
    addr = env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR")
    if not addr:
        raise ConfigError(
            f"{what} but no MASTER_ADDR / PET_MASTER_ADDR names the first pod (found "
            f"{_found(env)}): set MASTER_ADDR to its address, or start the pods under torchrun"
        )
    port = env.get("PET_MASTER_PORT") or env.get("MASTER_PORT") or str(DEFAULT_PORT)
    return f"{addr}:{port}"


def _torchrun_contract(env: dict[str, str]) -> Optional[PodJob]:
    low, high = _nodes(env["PET_NNODES"], env)
    nproc = env.get("PET_NPROC_PER_NODE", "auto")
    # auto / gpu / cpu: ours
    nproc_count = _int(env, "PET_NPROC_PER_NODE") if nproc.isdigit() else None
    restarts = _int(env, "PET_MAX_RESTARTS") if "PET_MAX_RESTARTS" in env else None
    if "PET_RDZV_ENDPOINT" in env:
        backend = env.get("PET_RDZV_BACKEND", "c10d")
        if backend == "static":
            raise ConfigError(
                "PET_RDZV_BACKEND=static with PET_RDZV_ENDPOINT: set PET_NODE_RANK and "
                f"MASTER_ADDR instead, or use the c10d backend (found {_found(env)})"
            )
        return PodJob(
            "PyTorchJob (elastic)",
            low,
            high,
            nproc_count,
            backend,
            env["PET_RDZV_ENDPOINT"],
            None,
            env.get("PET_RDZV_ID", "visiondist"),
            restarts,
        )
    if high == 1:
        return None
    if low != high:
        raise ConfigError(
            f"PET_NNODES={env['PET_NNODES']} is a range but no PET_RDZV_ENDPOINT names a "
            f"rendezvous (found {_found(env)}): give the job an elasticPolicy, or a fixed node "
            "count"
        )
    if "PET_NODE_RANK" not in env:
        raise ConfigError(
            f"PET_NNODES={high} but no PET_NODE_RANK says which node this pod is (found "
            f"{_found(env)}): set it to the pod's index, or start the pods under torchrun"
        )
    node_rank = _int(env, "PET_NODE_RANK")
    if not 0 <= node_rank < high:
        raise ConfigError(
            f"PET_NODE_RANK={node_rank} is not a node of PET_NNODES={high} (found {_found(env)})"
        )
    return PodJob(
        "Kubeflow Trainer / PyTorchJob",
        high,
        high,
        nproc_count,
        "static",
        _master(env, f"PET_NNODES={high}"),
        node_rank,
        env.get("PET_RDZV_ID", "visiondist"),
        restarts,
    )


def _pods_contract(env: dict[str, str]) -> Optional[PodJob]:
    missing = [k for k in ("WORLD_SIZE", "RANK") if k not in env]
    if missing:
        raise ConfigError(
            f"{' and '.join(missing)} not set where "
            f"{'RANK' if missing == ['WORLD_SIZE'] else 'WORLD_SIZE'} is (found {_found(env)}): a "
            "job of several pods sets both (WORLD_SIZE: the number of pods, RANK: this pod's "
            "index); unset the one left over, or start the pods under torchrun"
        )
    pods, rank = _int(env, "WORLD_SIZE"), _int(env, "RANK")
    if not 0 <= rank < max(pods, 1):
        raise ConfigError(f"RANK={rank} is not a pod of WORLD_SIZE={pods} (found {_found(env)})")
    if pods <= 1:
        return None
    return PodJob(
        "PyTorchJob (WORLD_SIZE read as pods)",
        pods,
        pods,
        None,
        "static",
        _master(env, f"WORLD_SIZE={pods}"),
        rank,
        "visiondist",
        None,
    )


def pod_ranks(cfg: Any, pod: PodJob, cuda_devices: int) -> int:
    """The ranks each pod starts: the contract's count, else trainer.devices, else the pod's GPUs,
    else (CPU pods) dp x tp x pp over the nodes, else tp x pp."""
    t, p = cfg.trainer, cfg.parallel
    if pod.nproc:
        if t.devices > 0 and t.devices != pod.nproc:
            raise ConfigError(
                f"trainer.devices={t.devices} but the job starts {pod.nproc} ranks per pod "
                "(PET_NPROC_PER_NODE): drop trainer.devices"
            )
        return pod.nproc
    if t.devices > 0:
        return t.devices
    if find_accelerator(cfg, cuda_devices) == "cuda":
        return cuda_devices
    if p.dp > 0:
        ranks = p.dp * p.tp * p.pp
        if ranks % pod.max_nodes:
            raise ConfigError(
                f"dp x tp x pp = {ranks} ranks do not split over {pod.max_nodes} pods: set "
                "trainer.devices to the ranks per pod"
            )
        return ranks // pod.max_nodes
    return p.tp * p.pp
