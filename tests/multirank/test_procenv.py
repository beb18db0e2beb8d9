"""What every process a command starts gets (visiondist.utils.procenv), read where it counts: OpenMP's own report of
its settings (OMP_DISPLAY_ENV=VERBOSE makes each process print it as OpenMP starts), and a start that prints nothing
a user cannot act on, on a machine without the internet. The CPU count's parts: tests/unit/test_procenv.py."""

import re
import subprocess
import sys

from helpers import REPO, TINY_DATA, finish_job, job_env, start_job

OFFLINE = {name: "http://127.0.0.1:9" for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")}
NOISE = ("Error fetching version info", "SyntaxWarning", "DeprecationWarning", "FutureWarning",
         "TORCH_NCCL_TRACE_BUFFER_SIZE", "is not shorter than the run", "UserWarning")


def _env(**extra: str) -> dict:
    env = job_env(OMP_DISPLAY_ENV="VERBOSE", **OFFLINE, **extra)
    for name in ("OMP_WAIT_POLICY", "NO_ALBUMENTATIONS_UPDATE"):
        if name not in extra:
            env.pop(name, None)
    return env


def test_a_two_rank_run_waits_passively_everywhere_and_starts_quietly_offline(tiny_shapes, tmp_path):
    """`tools/train.py` with 2 ranks (torch's elastic launcher) and a loader worker each, OMP_WAIT_POLICY unset,
    no internet: every process that starts OpenMP (the launcher, the ranks, ...) reports it passive (no spinning:
    GOMP_SPINCOUNT 0), and the output holds no warning: no albumentations version check, no warm-up longer than the
    4-step run (schedule.warmup_steps left at its default)."""
    args = [a for a in TINY_DATA if not a.startswith("data.num_workers")]
    proc = start_job([sys.executable, str(REPO / "tools" / "train.py"), *args, f"data.root={tiny_shapes}",
                      "data.batch_size=16", "data.num_workers=1", "parallel.dp=2", "trainer.accelerator=cpu",
                      "trainer.loggers=[csv]", "trainer.max_steps=4", f"trainer.run_dir={tmp_path / 'run'}"],
                     env=_env())
    out = finish_job(proc, 300, "the two-rank run")
    assert proc.returncode == 0, out[-4000:]
    spins = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", out)
    assert len(spins) >= 3 and set(spins) == {"0"}, spins  # the launcher and both ranks at least
    assert set(re.findall(r"OMP_WAIT_POLICY = '(\w+)'", out)) == {"PASSIVE"}
    said = "\n".join(line for line in out.splitlines() if not line.startswith(("  ", "OPENMP DISPLAY")))
    assert not [n for n in NOISE if n in said], said[-4000:]


def test_a_users_own_wait_policy_is_kept():
    """OMP_WAIT_POLICY=ACTIVE given by the user: OpenMP spins as asked (libgomp's count for ACTIVE)."""
    result = subprocess.run([sys.executable, str(REPO / "tools" / "train.py"), "--version"], cwd=REPO,
                            env=_env(OMP_WAIT_POLICY="ACTIVE"), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("visiondist"), result.stderr
    assert re.findall(r"GOMP_SPINCOUNT = '(\d+)'", result.stderr) == ["30000000000"], result.stderr
