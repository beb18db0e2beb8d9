"""The environment of every process visiondist starts, and the CPUs a process may use.

`set_process_defaults` runs once per process, from `visiondist/__init__.py`, so before torch or albumentations is
imported in any tool (tools/*.py import visiondist first) or rank under torchrun / srun; the ranks the launcher
starts and their loader workers inherit the environment. A user's own value of each variable is kept.

- `OMP_WAIT_POLICY=PASSIVE`: an OpenMP thread that waits for work sleeps instead of spinning. Spinning only pays on
  cores nothing else wants; beside one other busy process on 2 cores, a ViT-Ti step ran 13x slower with the
  spinning default (benchmarks/omp_wait.py, docs/performance.md). OpenMP reads it once, when torch loads it.
- `NO_ALBUMENTATIONS_UPDATE=1`: albumentations asks PyPI for its newest version at import, and on a machine without
  the internet prints the failed request at every start of every rank and loader worker.

`usable_cpus`: this process's CPUs, the smaller of its affinity (taskset, a SLURM allocation) and its container's CPU
quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`); the node's core count says nothing about a
pod limited to 4 CPUs on a 64-core node. Thread counts and `data.num_workers=-1` follow it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import MutableMapping, Optional

DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "NO_ALBUMENTATIONS_UPDATE": "1"}
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def set_process_defaults(env: MutableMapping[str, str] = os.environ) -> None:
    """`DEFAULTS` into `env` wherever the user has not set the variable."""
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)


def usable_cpus(root: Optional[Path] = None, proc_cgroup: Optional[Path] = None) -> int:
    """The CPUs this process may use: its affinity, or its cgroup's CPU quota where that is smaller (at least 1)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        affinity = os.cpu_count() or 1
    quota = cgroup_cpus(root, proc_cgroup)
    return max(1, min(affinity, quota) if quota is not None else affinity)


def cgroup_cpus(root: Optional[Path] = None, proc_cgroup: Optional[Path] = None) -> Optional[int]:
    """The CPU quota of this process's cgroup and its parents in whole CPUs (rounded down, at least 1), or None where
    none is set. cgroup v2: `cpu.max` ("max 100000": none; "400000 100000": 4 CPUs); v1: `cpu.cfs_quota_us` (-1:
    none) over `cpu.cfs_period_us`. `root`: where the cgroup file systems are mounted; `proc_cgroup`: the process's
    `/proc/<pid>/cgroup`, naming its cgroup under them (a container sees its own cgroup as the root)."""
    dirs = _cgroup_dirs(Path(root or CGROUP_ROOT), Path(proc_cgroup or PROC_CGROUP))
    quotas = [q for d in dirs if (q := _quota(d)) is not None]
    return max(1, int(min(quotas))) if quotas else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """The directories that may hold this process's CPU limits: its cgroup's (v2, and v1's cpu controller) and each
    parent's up to the mount point."""
    places: dict[str, str] = {}  # mount sub-directory -> the cgroup's path under it
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            places[""] = path
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                places[mount] = path
    places.setdefault("", "/")
    for mount in ("cpu", "cpu,cpuacct"):
        places.setdefault(mount, "/")
    dirs = []
    for mount, path in places.items():
        base = root / mount if mount else root
        here = base / path.strip("/")
        dirs.append(here)
        while here != base:
            here = here.parent
            dirs.append(here)
    return dirs


def _quota(directory: Path) -> Optional[float]:
    """The CPUs the limit files in `directory` allow, or None (no file, or no limit)."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def threads_per_rank(ranks_per_node: int) -> int:
    """The intra-op threads of each of a node's ranks: this process's CPUs shared between them, at least one."""
    return max(1, usable_cpus() // max(1, ranks_per_node))
