"""The environment of every process visiondist starts, and the CPUs a process may use.

`set_process_defaults` runs once per process, from `visiondist/__init__.py`, so before torch or
albumentations is imported in any tool (tools/*.py import visiondist first) or rank under torchrun /
srun; the ranks the launcher starts and their loader workers inherit the environment. A user's own
value of each variable is kept.

- OpenMP's waiting (`wait_policy`): a thread that runs out of work spins for a while (torch's
  default) or sleeps (`OMP_WAIT_POLICY=PASSIVE`). Spinning is fastest on CPUs nothing else wants
  (passive cost 12-18% on an idle 2-core machine); on CPUs another process wants it loses 1.7-16x (a
  ViT-Ti step beside one busy process: benchmarks/omp_wait.py, docs/performance.md). So the first
  visiondist process of a job looks before torch starts OpenMP: it waits passively where its CPUs
  are shared (a container's CPU quota below its CPUs, several ranks on the node, another visiondist
  job noted on them (`register_job`: two jobs started together sleep through each other's sample),
  or other processes keeping at least half a CPU of its CPUs busy over `SAMPLE_S`), and leaves
  torch's default otherwise. The choice and its reason go into `VISIONDIST_OMP_WAIT`, which the
  processes it starts inherit (they do not look again) and the run's log prints. OpenMP reads the
  policy once, when torch loads it.
- `NO_ALBUMENTATIONS_UPDATE=1`: albumentations asks PyPI for its newest version at import, and on a
  machine without the internet prints the failed request at every start of every rank and loader
  worker.

`environment_kept`: variables set for a block (a job's), the process's own values put back after it.

`usable_cpus`: this process's CPUs, the smaller of its affinity (taskset, a SLURM allocation) and
its container's CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`); the
node's core count says nothing about a pod limited to 4 CPUs on a 64-core node. Thread counts and
`data.num_workers=-1` follow it, shared by the node's ranks unless each has CPUs of its own
(`ranks_sharing_cpus`: srun's tasks bound with `--cpus-per-task`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, MutableMapping, Optional


@contextlib.contextmanager
def environment_kept(names: Iterable[str]) -> Iterator[None]:
    """The block may set the variables `names` (for the processes a job starts, or for itself);
    after it, each is as it was before, unset where it was unset."""
    before = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


DEFAULTS = {"NO_ALBUMENTATIONS_UPDATE": "1"}
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
PROC_STAT = Path("/proc/stat")
# the choice and its reason, for the processes started from here and the log
WAIT_RECORD = "VISIONDIST_OMP_WAIT"
SAMPLE_S = 0.1  # how long the first process watches its CPUs
SHARED_CPUS = 0.5  # other processes' use of this process's CPUs (in CPUs) that makes them shared
USER_SET = "set by you"


def set_process_defaults(
    env: MutableMapping[str, str] = os.environ,
    others_busy: Optional[Callable[[], Optional[float]]] = None,
) -> None:
    """`DEFAULTS` into `env` wherever the user has not set the variable, and OpenMP's waiting
    (`wait_policy`) unless the user or a parent process chose it."""
    for name, value in DEFAULTS.items():
        env.setdefault(name, value)
    if WAIT_RECORD in env:
        return  # a parent visiondist process chose, and its choice is in env
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        env[WAIT_RECORD] = (
            f"{env.get('OMP_WAIT_POLICY') or 'GOMP_SPINCOUNT=' + env['GOMP_SPINCOUNT']}: {USER_SET}"
        )
        return
    if others_busy is None:
        register_job()  # before the sample: jobs starting at the same moment see each other here
    policy, why = wait_policy(
        env, others_busy or others_cpu_use, other_jobs if others_busy is None else None
    )
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    env[WAIT_RECORD] = f"{policy or 'spin'}: {why}"


def ranks_share_cpus(ranks: int, env: MutableMapping[str, str] = os.environ) -> None:
    """Before `ranks` ranks start on this node from this process: with more than one they share its
    CPUs, so they wait passively, unless the user chose the policy."""
    if ranks > 1 and not env.get(WAIT_RECORD, "").endswith(USER_SET):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
        env[WAIT_RECORD] = f"PASSIVE: {ranks} ranks share this node's CPUs"


def wait_policy(
    env: MutableMapping[str, str],
    others_busy: Callable[[], Optional[float]],
    jobs: Optional[Callable[[], int]] = None,
) -> tuple[Optional[str], str]:
    """("PASSIVE" or None for torch's default spinning, why) for a process whose user set neither
    OMP_WAIT_POLICY nor GOMP_SPINCOUNT. `others_busy()`: the CPUs other processes keep busy of this
    process's CPUs (None: unknown); `jobs()`: the other visiondist jobs on these CPUs
    (`register_job`)."""
    ranks = int(env.get("LOCAL_WORLD_SIZE") or 1)
    if ranks > 1:
        return "PASSIVE", f"{ranks} ranks share this node's CPUs"
    affinity = _affinity()
    quota = cgroup_quota()
    if quota is not None and quota < affinity:
        return "PASSIVE", (
            f"the container's CPU quota ({quota:g} CPUs) is below its {affinity} CPUs: they are "
            "throttled, not idle"
        )
    busy = others_busy()
    if busy is not None and busy >= SHARED_CPUS:
        return (
            "PASSIVE",
            f"other processes kept {busy:.1f} of this process's {affinity} CPUs busy at start",
        )
    others = jobs() if jobs is not None else 0
    if others:
        return "PASSIVE", (
            f"{others} other visiondist job{'s share' if others > 1 else ' shares'} this process's "
            "CPUs"
        )
    if busy is None:
        return "PASSIVE", "other processes' use of the CPUs cannot be read here"
    return None, (
        f"torch's default; other processes kept {busy:.1f} of this process's {affinity} CPUs busy "
        "at start; set OMP_WAIT_POLICY=PASSIVE where other work will share them"
    )


def omp_wait_text(env: MutableMapping[str, str] = os.environ) -> str:
    """How this process's OpenMP threads wait and why, for the log."""
    policy, _, why = env.get(WAIT_RECORD, "").partition(": ")
    if not policy:
        return f"follow OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY', '(unset)')}"
    if policy.startswith("GOMP_SPINCOUNT="):
        return f"spin {policy.partition('=')[2]} rounds, then sleep (GOMP_SPINCOUNT, {why})"
    return (
        "sleep"
        if policy.upper() == "PASSIVE"
        else "spin"
        if policy in ("spin", "ACTIVE")
        else policy
    ) + f" ({why})"


def _jobs_dir() -> Path:
    return (
        Path(tempfile.gettempdir())
        / f"visiondist-jobs-{os.getuid() if hasattr(os, 'getuid') else 0}"
    )


def register_job(directory: Optional[Path] = None) -> None:
    """Note this process (the first visiondist process of a job) and its CPUs in a per-user
    directory, removed when it exits: two jobs that start together each sleep through the other's
    sample of the CPUs, but find its note."""
    directory = Path(directory or _jobs_dir())
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        note = directory / str(os.getpid())
        note.write_text(" ".join(map(str, sorted(_cpus()))))
    except OSError:
        return
    atexit.register(lambda: note.unlink(missing_ok=True))


def other_jobs(directory: Optional[Path] = None) -> int:
    """The other live jobs `register_job` noted whose CPUs overlap this process's (notes of ended
    ones removed)."""
    directory = Path(directory or _jobs_dir())
    mine, count = _cpus(), 0
    try:
        notes = [n for n in directory.iterdir() if n.name.isdigit() and int(n.name) != os.getpid()]
    except OSError:
        return 0
    for note in notes:
        try:
            os.kill(int(note.name), 0)
        except ProcessLookupError:  # ended without removing its note (killed)
            note.unlink(missing_ok=True)
            continue
        # alive, another user's (cannot happen in a per-user directory, but costs nothing)
        except OSError:
            pass
        try:
            theirs = {int(c) for c in note.read_text().split()}
        except (OSError, ValueError):
            continue
        count += bool(theirs & mine) or not theirs
    return count


def _cpus() -> set[int]:
    """This process's CPUs: its affinity, or every CPU where the platform has none."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return set(range(os.cpu_count() or 1))


def others_cpu_use(seconds: float = SAMPLE_S, stat: Optional[Path] = None) -> Optional[float]:
    """The CPUs (of this process's affinity) that other processes kept busy over `seconds`, from the
    per-CPU lines of /proc/stat (None where it cannot be read); this process sleeps meanwhile."""
    cpus, path = _cpus(), Path(stat or PROC_STAT)  # no /proc/stat where there is no affinity either

    def busy() -> Optional[float]:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return None
        total = 0
        for line in lines:
            name, *fields = line.split() or [""]
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                user, nice, system, _, _, irq, softirq, steal = (list(map(int, fields)) + [0] * 8)[
                    :8
                ]
                total += user + nice + system + irq + softirq + steal
        return total / os.sysconf("SC_CLK_TCK")

    own, start, before = time.process_time(), time.perf_counter(), busy()
    if before is None:
        return None
    time.sleep(seconds)
    after = busy()
    if after is None:
        return None
    return max(0.0, (after - before) - (time.process_time() - own)) / (time.perf_counter() - start)


def _affinity() -> int:
    return len(_cpus())


def usable_cpus(root: Optional[Path] = None, proc_cgroup: Optional[Path] = None) -> int:
    """The CPUs this process may use: its affinity, or its cgroup's CPU quota where that is smaller
    (at least 1)."""
    quota = cgroup_cpus(root, proc_cgroup)
    return max(1, min(_affinity(), quota) if quota is not None else _affinity())


def cgroup_cpus(root: Optional[Path] = None, proc_cgroup: Optional[Path] = None) -> Optional[int]:
    """The CPU quota of this process's cgroup and its parents in whole CPUs (rounded down, at least
    1), or None where none is set. cgroup v2: `cpu.max` ("max 100000": none; "400000 100000": 4
    CPUs); v1: `cpu.cfs_quota_us` (-1: none) over `cpu.cfs_period_us`. `root`: where the cgroup file
    systems are mounted; `proc_cgroup`: the process's `/proc/<pid>/cgroup`, naming its cgroup under
    them (a container sees its own cgroup as the root)."""
    quota = cgroup_quota(root, proc_cgroup)
    return max(1, int(quota)) if quota is not None else None


def cgroup_quota(
    root: Optional[Path] = None, proc_cgroup: Optional[Path] = None
) -> Optional[float]:
    """`cgroup_cpus`'s quota as the CPUs it allows (1.5: one and a half), or None."""
    dirs = _cgroup_dirs(Path(root or CGROUP_ROOT), Path(proc_cgroup or PROC_CGROUP))
    quotas = [q for d in dirs if (q := _quota(d)) is not None]
    return min(quotas) if quotas else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """The directories that may hold this process's CPU limits: its cgroup's (v2, and v1's cpu
    controller) and each parent's up to the mount point."""
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
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        period_us = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def omp_threads(env: MutableMapping[str, str] = os.environ) -> Optional[int]:
    """OMP_NUM_THREADS as one positive thread count; None where it is unset or is not one count (a
    nested list such as "4,2", which OpenMP reads itself as it loads)."""
    value = env.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def ranks_sharing_cpus(ranks_per_node: int, env: MutableMapping[str, str] = os.environ) -> int:
    """How many of a node's ranks share this process's CPUs: 1 where srun started each rank as a
    task bound to CPUs of its own (`srun --cpus-per-task=N`, tools/slurm_train.sh: one task per
    rank, this task's affinity at most N CPUs), else all `ranks_per_node` (the ranks of a
    self-launch or of one torchrun per node inherit one affinity)."""
    per_task, tasks = env.get("SLURM_CPUS_PER_TASK", ""), env.get("SLURM_STEP_NUM_TASKS")
    one_task_per_rank = tasks is not None and tasks == env.get("WORLD_SIZE")
    if one_task_per_rank and per_task.isdigit() and _affinity() <= int(per_task):
        return 1
    return max(1, ranks_per_node)


def threads_per_rank(ranks_per_node: int) -> int:
    """The intra-op threads of each of a node's ranks: this process's CPUs shared between them, at
    least one."""
    return max(1, usable_cpus() // max(1, ranks_per_node))
