"""The CPUs a process may use (affinity and container quota) and the environment every process gets.
The started processes themselves (a tool, its ranks, their loader workers):
tests/multirank/test_procenv.py."""

import os
import subprocess
import time
from pathlib import Path

from visiondist.utils import procenv


def _cgroup(tmp_path, proc: str, files: dict[str, str]):
    """A fake cgroup mount (`files`: path under it -> text) and /proc/self/cgroup (`proc`)."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    return root, tmp_path / "proc_cgroup"


def test_the_cgroup_v2_quota_in_whole_cpus(tmp_path):
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert procenv.cgroup_cpus(root, proc) is None  # no limit
    (root / "cpu.max").write_text("400000 100000\n")
    assert procenv.cgroup_cpus(root, proc) == 4
    (root / "cpu.max").write_text("150000 100000\n")
    assert procenv.cgroup_cpus(root, proc) == 1  # 1.5 CPUs: one whole
    (root / "cpu.max").write_text("20000 100000\n")
    assert procenv.cgroup_cpus(root, proc) == 1  # at least one


def test_the_smallest_quota_of_the_cgroup_and_its_parents(tmp_path):
    """A pod's cgroup under a node's kubepods: the pod's 4 CPUs, not the parent's 64 nor an
    unlimited child."""
    root, proc = _cgroup(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "kubepods/cpu.max": "6400000 100000",
            "kubepods/pod1/cpu.max": "400000 100000",
            "kubepods/pod1/ctr/cpu.max": "max 100000",
        },
    )
    assert procenv.cgroup_cpus(root, proc) == 4


def test_the_cgroup_v1_quota(tmp_path):
    root, proc = _cgroup(
        tmp_path,
        "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n",
        {
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "800000",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        },
    )
    assert procenv.cgroup_cpus(root, proc) == 8
    (root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1")
    assert procenv.cgroup_cpus(root, proc) is None
    # a container that sees its own cgroup at the mount point, whatever /proc names
    root, proc = _cgroup(
        tmp_path / "c",
        "2:cpu,cpuacct:/kubepods/gone\n",
        {"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"},
    )
    assert procenv.cgroup_cpus(root, proc) == 3


def test_usable_cpus_is_the_smaller_of_affinity_and_quota(tmp_path, monkeypatch):
    """A pod limited to 4 CPUs on a 64-core node: 4, so data.num_workers=-1 starts 3 workers, not 15
    (or 63)."""
    from visiondist.data import workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "400000 100000"})
    assert procenv.usable_cpus(root, proc) == 4
    monkeypatch.setattr(procenv, "CGROUP_ROOT", root)
    monkeypatch.setattr(procenv, "PROC_CGROUP", proc)
    assert workers.loader_workers(-1, 1) == 3 and procenv.threads_per_rank(2) == 2
    (root / "cpu.max").write_text("max 100000")
    assert procenv.usable_cpus(root, proc) == 64
    # taskset -c 0,1 under a larger quota
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    (root / "cpu.max").write_text("800000 100000")
    assert procenv.usable_cpus(root, proc) == 2


def _never() -> float:
    raise AssertionError("the CPUs were sampled where the choice was already made")


def test_a_users_own_wait_policy_or_spin_count_is_kept_and_nothing_is_sampled():
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    procenv.set_process_defaults(env, others_busy=_never)
    assert env == {
        "OMP_WAIT_POLICY": "ACTIVE",
        "NO_ALBUMENTATIONS_UPDATE": "1",
        procenv.WAIT_RECORD: "ACTIVE: set by you",
    }
    # libgomp's own spin count: no policy added, which would change it
    env = {"GOMP_SPINCOUNT": "1000"}
    procenv.set_process_defaults(env, others_busy=_never)
    assert (
        "OMP_WAIT_POLICY" not in env
        and env[procenv.WAIT_RECORD] == "GOMP_SPINCOUNT=1000: set by you"
    )
    assert procenv.omp_wait_text(env) == "spin 1000 rounds, then sleep (GOMP_SPINCOUNT, set by you)"


def test_a_started_process_inherits_its_parents_choice_without_looking_again():
    env = {procenv.WAIT_RECORD: "spin: torch's default", "NO_ALBUMENTATIONS_UPDATE": "1"}
    procenv.set_process_defaults(env, others_busy=_never)
    assert "OMP_WAIT_POLICY" not in env and env[procenv.WAIT_RECORD] == "spin: torch's default"


def test_busy_cpus_at_start_wait_passively_idle_ones_keep_torchs_default(monkeypatch, tmp_path):
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    monkeypatch.setattr(procenv, "CGROUP_ROOT", root)
    monkeypatch.setattr(procenv, "PROC_CGROUP", proc)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    env = {}
    procenv.set_process_defaults(env, others_busy=lambda: 1.0)  # one busy process beside
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert (
        procenv.omp_wait_text(env)
        == "sleep (other processes kept 1.0 of this process's 2 CPUs busy at start)"
    )
    env = {}
    procenv.set_process_defaults(env, others_busy=lambda: 0.1)
    assert "OMP_WAIT_POLICY" not in env and procenv.omp_wait_text(env).startswith(
        "spin (torch's default; other processes kept 0.1 of"
    )
    env = {}
    # no /proc/stat: the choice that cannot lose much
    procenv.set_process_defaults(env, others_busy=lambda: None)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    env = {"LOCAL_WORLD_SIZE": "8"}  # torchrun's ranks of one node: each would see the others start
    procenv.set_process_defaults(env, others_busy=_never)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "8 ranks share" in env[procenv.WAIT_RECORD]
    # a pod limited to 1.5 of its 2 CPUs: throttled
    (root / "cpu.max").write_text("150000 100000\n")
    env = {}
    procenv.set_process_defaults(env, others_busy=_never)
    assert (
        env["OMP_WAIT_POLICY"] == "PASSIVE"
        and "quota (1.5 CPUs) is below its 2 CPUs" in env[procenv.WAIT_RECORD]
    )


def test_several_ranks_started_from_one_process_wait_passively_unless_the_user_chose():
    env = {procenv.WAIT_RECORD: "spin: torch's default"}
    procenv.ranks_share_cpus(1, env)
    assert env == {procenv.WAIT_RECORD: "spin: torch's default"}
    procenv.ranks_share_cpus(2, env)
    assert env == {
        "OMP_WAIT_POLICY": "PASSIVE",
        procenv.WAIT_RECORD: "PASSIVE: 2 ranks share this node's CPUs",
    }
    env = {"OMP_WAIT_POLICY": "ACTIVE", procenv.WAIT_RECORD: "ACTIVE: set by you"}
    procenv.ranks_share_cpus(4, env)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_the_sample_sees_a_busy_process_on_this_process_cpus():
    """A spinning process (it inherits this process's CPUs) is counted; this process's own sleep is
    not."""
    spinner = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        time.sleep(0.3)  # started
        busy = procenv.others_cpu_use(0.3)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and 0.7 <= busy <= len(os.sched_getaffinity(0)) + 0.1, busy
    assert procenv.others_cpu_use(0.05, stat=Path("/nonexistent/stat")) is None


def test_jobs_started_together_find_each_others_note(tmp_path, monkeypatch):
    """Two jobs that start at the same moment each sleep through the other's sample of the CPUs: the
    note each leaves first (its pid and CPUs) makes both wait passively; notes of ended jobs and of
    other CPUs do not count."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    procenv.register_job(tmp_path)
    # itself
    assert (tmp_path / str(os.getpid())).read_text() == "0 1" and procenv.other_jobs(tmp_path) == 0
    (tmp_path / str(os.getppid())).write_text("1 2")  # a live job on CPU 1 too
    (tmp_path / "4999999").write_text("0 1")  # beyond any pid: a job that was killed
    assert procenv.other_jobs(tmp_path) == 1 and not (tmp_path / "4999999").exists()
    (tmp_path / str(os.getppid())).write_text("6 7")  # pinned to other CPUs: not sharing
    assert procenv.other_jobs(tmp_path) == 0
    policy, why = procenv.wait_policy({}, lambda: 0.0, lambda: 1)
    assert policy == "PASSIVE" and why == "1 other visiondist job shares this process's CPUs"


def test_omp_num_threads_is_one_count_or_left_to_openmp():
    """One positive count is read as the ranks' thread count (and one thread a rank forks the ranks
    from the launcher: visiondist.launch.spawn); unset, zero or a nested list ("4,2") is not one
    count."""
    from visiondist.launch.spawn import start_method

    counts = {v: procenv.omp_threads({"OMP_NUM_THREADS": v}) for v in ("1", "4", "0", "4,2", "")}
    assert counts == {"1": 1, "4": 4, "0": None, "4,2": None, "": None}
    assert procenv.omp_threads({}) is None
    assert [start_method(False, n) for n in (1, 4, None)] == ["fork", "forkserver", "forkserver"]
    assert start_method(True, 1) == "spawn"


def test_ranks_crowding_the_cpus_are_told_their_step_times_are_not_the_layouts():
    """tp2 x pp2 on a 2-core machine: 4 ranks take turns on 2 CPUs; the start-up line says so,
    and says nothing where each rank has a CPU of its own (srun's bound tasks count as 1)."""
    from visiondist.engine.announce import _crowded_text

    said = _crowded_text(4, 2)
    assert "4 ranks on 2 CPUs take turns" in said and "step times say nothing" in said
    assert _crowded_text(2, 2) == _crowded_text(1, 16) == ""
    env = {"SLURM_CPUS_PER_TASK": "64", "SLURM_STEP_NUM_TASKS": "4", "WORLD_SIZE": "4"}
    assert _crowded_text(procenv.ranks_sharing_cpus(4, env), 2) == ""
