"""What every process a command starts gets (visiondist.utils.procenv), read where it counts:
OpenMP's own report of its settings (OMP_DISPLAY_ENV=VERBOSE makes each process print it as OpenMP
starts), a start that prints nothing a user cannot act on, on a machine without the internet, and
ranks that can run autograd whatever their launcher ran. The CPU count's parts:
tests/unit/test_procenv.py."""

import re
import subprocess
import sys

from helpers import REPO, TINY_DATA, finish_job, job_env, start_job

from visiondist.utils.procenv import WAIT_RECORD

OFFLINE = {
    name: "http://127.0.0.1:9"
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
}
NOISE = (
    "Error fetching version info",
    "SyntaxWarning",
    "DeprecationWarning",
    "FutureWarning",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
    "is not shorter than the run",
    "UserWarning",
)


def _env(**extra: str) -> dict:
    env = job_env(OMP_DISPLAY_ENV="VERBOSE", **OFFLINE, **extra)
    for name in ("OMP_WAIT_POLICY", "NO_ALBUMENTATIONS_UPDATE", "GOMP_SPINCOUNT", WAIT_RECORD):
        if name not in extra:
            env.pop(name, None)
    return env


def _train(tiny_shapes, tmp_path, *overrides: str, env: dict) -> str:
    args = [a for a in TINY_DATA if not a.startswith("data.num_workers")]
    proc = start_job(
        [
            sys.executable,
            str(REPO / "tools" / "train.py"),
            *args,
            f"data.root={tiny_shapes}",
            "data.batch_size=16",
            "data.num_workers=1",
            "trainer.accelerator=cpu",
            "trainer.loggers=[csv]",
            "trainer.max_steps=4",
            f"trainer.run_dir={tmp_path / 'run'}",
            *overrides,
        ],
        env=env,
        fresh=True,
    )  # what a process does as it starts is the subject
    out = finish_job(proc, 300, "the run")
    assert proc.returncode == 0, out[-4000:]
    return out


def test_beside_a_busy_process_every_process_waits_passively_and_starts_quietly_offline(
    tiny_shapes, tmp_path
):
    """The user's case: `tools/train.py` with one rank and a loader worker started beside a busy
    process, OMP_WAIT_POLICY unset, no internet: the tool sees the CPUs shared, and every process
    that starts OpenMP (the tool, the rank, ...) reports it passive (no spinning: GOMP_SPINCOUNT 0);
    the log says why, and the output holds no warning: no albumentations version check, no warm-up
    longer than the 4-step run (schedule.warmup_steps left at its default)."""
    busy = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    temp = tmp_path / "tmp"
    temp.mkdir()
    try:
        out = _train(tiny_shapes, tmp_path, env=_env(TMPDIR=str(temp)))
    finally:
        busy.kill()
        busy.wait()
    # its killed loader worker's socket directory went with the rank
    assert _litter(temp) == [], _litter(temp)
    spins = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out)
    assert len(spins) >= 2 and set(spins) == {"0"}, spins  # the tool and the rank at least
    assert set(re.findall(r"OMP_WAIT_POLICY = '(\w+)'", out)) == {"PASSIVE"}
    assert "OpenMP's waiting threads sleep (other processes kept" in out, out[-4000:]
    said = "\n".join(
        line for line in out.splitlines() if not line.startswith(("  ", "OPENMP DISPLAY"))
    )
    assert not [n for n in NOISE if n in said], said[-4000:]


def _litter(temp) -> list[str]:
    """What a job left in its temp dir beyond the per-user job notes (emptied at exit, checked
    below) and inductor's cache."""
    return sorted(
        p.name
        for p in temp.iterdir()
        if not p.name.startswith(("visiondist-jobs-", "torchinductor"))
    )


def test_the_ranks_of_a_two_rank_run_wait_passively(tiny_shapes, tmp_path):
    """Two ranks started by the tool share its CPUs: whatever the tool chose for itself (it may have
    found them idle), both ranks and their loader workers wait passively and say why. Two threads a
    rank (the suite's jobs run one): ranks with threads that wait start OpenMP afresh, from the fork
    server (visiondist.launch.spawn). The job leaves its temp dir as it found it: before, the
    elastic agent's `torchelastic_*` directory and each killed loader worker's `pymp-*` stayed."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = _train(
        tiny_shapes, tmp_path, "parallel.dp=2", env=_env(OMP_NUM_THREADS="2", TMPDIR=str(temp))
    )
    assert _litter(temp) == [], _litter(temp)
    assert not [n for d in temp.glob("visiondist-jobs-*") for n in d.iterdir()]
    assert "CPU: 2 threads per rank" in out, out[-4000:]
    policies = re.findall(r"OMP_WAIT_POLICY = '(\w+)'", out)
    # both ranks (the tool's own line may say either)
    assert policies.count("PASSIVE") >= 2, policies
    assert "OpenMP's waiting threads sleep (2 ranks share this node's CPUs)" in out, out[-4000:]


def test_a_users_own_wait_policy_is_kept():
    """OMP_WAIT_POLICY=ACTIVE given by the user: OpenMP spins as asked (libgomp's count for
    ACTIVE)."""
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "train.py"), "--version"],
        cwd=REPO,
        env=_env(OMP_WAIT_POLICY="ACTIVE"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.startswith("visiondist"), result.stderr
    assert re.findall(r"GOMP_SPINCOUNT = '(\d+)'", result.stderr) == ["30000000000"], result.stderr


def test_two_jobs_started_together_both_wait_passively(tmp_path):
    """Two tools started at the same moment each sleep through the other's 0.1 s sample of the CPUs:
    the note each leaves first (in its own TMPDIR here, away from this test run's processes) makes
    both wait passively."""
    # each stays alive a second after its choice, as a job does (one that ended has removed its
    # note)
    code = (
        "import os, time, visiondist; print(os.environ['VISIONDIST_OMP_WAIT'], flush=True); "
        "time.sleep(1)"
    )
    env = {**_env(TMPDIR=str(tmp_path)), "OMP_DISPLAY_ENV": "FALSE"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    said = [p.communicate(timeout=60)[0].strip() for p in procs]
    # each other's note, or a busy machine's sample
    assert all(s.startswith("PASSIVE: ") for s in said), said
    # each note removed at exit
    assert not [n for d in tmp_path.glob("visiondist-jobs-*") for n in d.iterdir()]


RANK_BACKWARD = """
def one_backward():
    import torch

    weight = torch.ones(3, requires_grad=True)
    (weight * 2).sum().backward()
    return weight.grad.tolist()
"""
AFTER_FAKE_BACKWARD = """
import torch

from visiondist.launch.spawn import autograd_survives_fork, spawn_local


# the fork server imports this file as __main__: its work only under the guard, as
# multiprocessing asks
def main():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rank_backward import one_backward

    print("before:", autograd_survives_fork())
    # a backward on fake tensors, as `tools/plan.py verify=` measures a layout's step
    with FakeTensorMode():
        fake = torch.ones(3, requires_grad=True)
        (fake * 2).sum().backward()
    print("after:", autograd_survives_fork())
    print("ranks:", sorted(spawn_local(one_backward, 2, cuda=False).items()))


if __name__ == "__main__":
    main()
"""


def test_ranks_train_when_the_launching_process_ran_autograd_off_the_cpu(tmp_path):
    """A process that ran a backward off the CPU (on fake tensors here) has started autograd's
    device threads, and a child forked from it refuses every backward. Ranks launched from such a
    process (a notebook, a test process) start from a fresh fork server instead of being forked from
    it, and run their backward. In a fresh interpreter, since the process that did so stays so."""
    (tmp_path / "rank_backward.py").write_text(RANK_BACKWARD)
    (tmp_path / "launch.py").write_text(AFTER_FAKE_BACKWARD)
    env = job_env(PYTHONPATH=f"{tmp_path}:{REPO}")
    result = subprocess.run(
        [sys.executable, str(tmp_path / "launch.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert result.stdout.splitlines() == [
        "before: True",
        "after: False",
        # said where it matters: the ranks' start costs more
        "the ranks start from a fresh fork server, not forked from this process: it ran autograd "
        "off the CPU (a GPU, or a layout's check on fake tensors), which a forked rank cannot "
        "survive (about 3 s more to start)",
        "ranks: [(0, [2.0, 2.0, 2.0]), (1, [2.0, 2.0, 2.0])]",
    ], result.stdout
