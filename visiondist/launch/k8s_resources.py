"""What each pod of a Kubernetes job of `tools/k8s.py` requests, and is limited to
(`visiondist.launch.k8s` writes it into the manifest): its CPUs (one per rank and one per loader
worker), its /dev/shm (the batches its workers keep ready) and its memory (the ranks, their workers
and /dev/shm, which counts against it). Requests equal limits, so that the pods are in the
Guaranteed class, the last the kubelet evicts. `cpu=` and `memory=` (Kubernetes quantities)
replace the figures; a memory below the plan is refused or said, with what it holds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from visiondist.config import ConfigError
from visiondist.config.schema import DETECTION_FORMATS

# data.num_workers=-1 without cpu=: the loader workers per rank a pod is sized for (8 CPUs a GPU)
AUTO_WORKERS = 7
# host memory of a GPU rank: torch and CUDA libraries and context, pinned batches, checkpoint
# staging
RANK_GIB = 6.0
# one loader worker: decoders, augmentation buffers, the pages of the index it writes to
WORKER_GIB = 1.0
SHM_MIN_GIB = 1  # /dev/shm at least this
GIB = 1024**3
_CPU = re.compile(r"(\d+(\.\d+)?)(m?)")
_MEMORY = re.compile(r"(\d+(\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?")
_UNITS = {
    None: 1,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": GIB,
    "Ti": 1024**4,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
}


@dataclass(frozen=True)
class PodResources:
    """What each pod requests (and is limited to), as Kubernetes quantities, and what it was sized
    for."""

    cpu: str
    memory: str
    shm: str  # the /dev/shm volume's sizeLimit (inside `memory`)
    ranks: int
    workers: int  # loader workers per rank
    # `memory=` below the planned figure: what it holds instead, said on the tool's line
    short: str = ""


def cpu_count_of(value: str) -> float:
    """`cpu=` as CPUs ("16", "7.5", "15500m"), or a one-line refusal."""
    match = _CPU.fullmatch(value.strip())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(
            f"cpu={value}: give the CPUs of each pod as Kubernetes writes them, e.g. cpu=64 or "
            "cpu=63500m"
        )
    return float(match.group(1)) / (1000 if match.group(3) else 1)


def bytes_of(value: str) -> float:
    """`memory=` in bytes ("256Gi", "200G", "512Mi"), or a one-line refusal."""
    match = _MEMORY.fullmatch(value.strip())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(
            f"memory={value}: give the memory of each pod as Kubernetes writes it, e.g. "
            "memory=256Gi"
        )
    return float(match.group(1)) * _UNITS[match.group(3)]


def pod_resources(
    cfg: Any, ranks: int, dp: int, cpu: str = "", memory: str = "", staging_gib: float = 0.0
) -> PodResources:
    """A pod of `ranks` ranks (`dp` data-parallel groups in the job): its CPUs (`cpu=`, else one per
    rank and one per loader worker: data.num_workers, or `AUTO_WORKERS` for -1), its /dev/shm (the
    batches its workers keep ready, twice over, at least `SHM_MIN_GIB`) and its memory (`memory=`,
    else `RANK_GIB` a rank, plus `staging_gib` (trainer.checkpoint_async's copy of the rank's
    training state), `WORKER_GIB` a worker, plus /dev/shm)."""
    # OpenCV comes with it (18 ms), which tools/k8s.py --cfg job does not need
    from visiondist.data.workers import loader_workers  # noqa: PLC0415 (OpenCV, 18 ms)

    d = cfg.data
    rank_gib = RANK_GIB + staging_gib
    requested = int(d.num_workers)
    if cpu:
        cpus = cpu_count_of(cpu)
        # -1: what the pods' CPU quota gives them
        workers = loader_workers(requested, ranks, cores=int(cpus))
    else:
        workers = requested if requested >= 0 else AUTO_WORKERS
        cpus = ranks * (1 + workers)
    per_rank_batch = -(-int(d.batch_size) // max(1, dp * int(cfg.trainer.grad_accum)))
    # uint8
    image = 3 * (
        int(d.min_size) * int(d.max_size) if d.format in DETECTION_FORMATS else int(d.img_size) ** 2
    )
    ready = ranks * workers * int(d.get("prefetch_factor", 2)) * per_rank_batch * image
    shm_gib = max(SHM_MIN_GIB, math.ceil(2 * ready / GIB))
    planned = shm_gib + math.ceil(ranks * (rank_gib + workers * WORKER_GIB))
    floor = shm_gib + math.ceil(ranks * rank_gib)  # the ranks and /dev/shm, no loader worker
    short = ""
    if memory:
        given = bytes_of(memory) / GIB
        if given < floor:
            raise ConfigError(
                f"memory={memory} is below what the pod's {ranks} ranks need: {rank_gib:g}Gi a "
                "rank (torch and CUDA, pinned batches, checkpoint staging) and /dev/shm "
                f"{shm_gib}Gi (which counts against it) make {floor}Gi without a loader worker: "
                f"give memory={planned}Gi (the planned figure, with {workers} loader workers a "
                f"rank at {WORKER_GIB:g}Gi each), or at least {floor}Gi with fewer workers "
                "(data.num_workers)"
            )
        if given < planned:
            fit = int((given - floor) // (ranks * WORKER_GIB))
            short = (
                f"memory={memory} is below the planned {planned}Gi: beside the {ranks} ranks "
                f"({ranks * rank_gib:g}Gi) and /dev/shm ({shm_gib}Gi) it leaves room for {fit} of "
                f"the {workers} loader workers a rank the pods would start ({WORKER_GIB:g}Gi "
                f"each): add data.num_workers={fit} to the command or give memory={planned}Gi, "
                "else the pods may be killed for memory"
            )
    else:
        memory = f"{planned}Gi"
    cpu = cpu.strip() if cpu else str(int(cpus))
    return PodResources(
        cpu=cpu,
        memory=memory.strip(),
        shm=f"{shm_gib}Gi",
        ranks=ranks,
        workers=workers,
        short=short,
    )
