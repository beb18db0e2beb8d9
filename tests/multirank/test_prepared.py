"""The prepared interpreter the tests fork tool runs from (tests/prepared.py: PreparedRun) gives
what a fresh `python <script>` gives: the command line, working directory, environment, `__name__`,
sys.path[0], output, exit code, a traceback's exit, a signal's end and Ctrl-C's."""

import os
import signal
import sys
import time

import pytest
from helpers import job_env, start_job
from prepared import PreparedRun, prepared_for

SCRIPT = """
import os, signal, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "name", __name__,
      "path0", sys.path[0] == os.path.dirname(__file__))
print("env", os.environ.get("PREPARED_TEST"), "session", os.getsid(0) == os.getpid())
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise ValueError("the script failed")
if how == "interrupt":
    raise KeyboardInterrupt
if how == "wait":
    print("waiting", flush=True)
    time.sleep(60)
sys.exit(int(how))
"""


def _both(tmp_path, *args, signal_after=None):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = job_env(PREPARED_TEST="yes")
    command = [str(script), *args]
    assert prepared_for(command, env, job_env())
    results = []
    for proc in (
        PreparedRun(command, env, tmp_path),
        start_job([sys.executable, *command], env, tmp_path, fresh=True),
    ):
        if signal_after is not None:
            time.sleep(signal_after)
            os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        results.append((proc.returncode, sorted(out.splitlines())))
    return results


@pytest.mark.parametrize(
    "how, code", [("0", 0), ("3", 3), ("raise", 1), ("interrupt", -signal.SIGINT)]
)
def test_a_forked_run_ends_as_a_fresh_one(tmp_path, how, code):
    prepared, fresh = _both(tmp_path, how)
    assert prepared[0] == fresh[0] == code

    def said(lines):  # without a traceback's frames (runpy's differ)
        return [line for line in lines if not line.startswith((" ", "Traceback"))]

    assert said(prepared[1]) == said(fresh[1])
    assert f"argv ['{how}'] cwd {tmp_path} name __main__ path0 True" in prepared[1]
    assert "env yes session True" in prepared[1] and "to stderr" in prepared[1]
    assert ("ValueError: the script failed" in prepared[1]) == (how == "raise")
    assert ("KeyboardInterrupt" in prepared[1]) == (how == "interrupt")


def test_sigterm_ends_a_forked_run_as_a_fresh_one(tmp_path):
    prepared, fresh = _both(tmp_path, "wait", signal_after=1.0)
    assert prepared[0] == fresh[0] == -signal.SIGTERM


def test_a_run_whose_start_up_environment_differs_starts_fresh(tmp_path):
    assert not prepared_for([str(tmp_path / "x.py")], job_env(OMP_NUM_THREADS="2"), job_env())
    assert not prepared_for(["-c", "pass"], job_env(), job_env())
    assert prepared_for(["-m", "json.tool"], job_env(SOMETHING_ELSE="1"), job_env())


@pytest.mark.parametrize("fresh", [False, True], ids=["prepared", "fresh"])
def test_a_job_past_its_timeout_says_where_it_hung(tmp_path, fresh):
    """A run that outlives its test's timeout ends, and its output shows its threads' stacks
    (faulthandler on SIGABRT), forked from the prepared interpreter or started fresh."""
    from helpers import finish_job

    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = start_job([sys.executable, str(script), "wait"], job_env(), tmp_path, fresh=fresh)
    assert isinstance(proc, PreparedRun) != fresh
    with pytest.raises(AssertionError, match="did not finish in 3s") as failed:
        finish_job(proc, 3, "script.py wait")
    said = str(failed.value)
    assert "waiting" in said and "Fatal Python error: Aborted" in said, said
    assert 'File "' in said and "script.py" in said, said
